"""Claims: bad input is stopped early, counted, and explained.
1. At config load (before any model loads), each bad recipe value or override raises a
   ConfigError whose message names the key and says "Fix:": unknown/misspelled keys (in an
   override, with `+`, or in a recipe file, with the nearest real key suggested), wrong types,
   out-of-range values, resources the loop cannot use, unsupported combinations. `vime train`
   with such a value exits in seconds, having built no model and written no run directory.
2. A model length the checkpoint cannot hold is refused by preflight, still before any load.
3. Malformed dataset rows — missing fields, wrong types, empty prompts, no ground truth,
   prompts too long for the engine — are quarantined with a counted reason
   (`data_report.json`), never fed to the engine.
4. A reward function that raises, hangs, returns a non-number or kills its process is
   counted per reason, its sample gets 0.0 with that status, and the following samples are
   scored normally (a hang is killed after `reward.timeout_s`)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.config import RECIPES, ConfigError, load_config
from vime.data.prompts import load_prompts
from vime.data.reward_worker import RewardWorker
from vime.preflight import PreflightError, check_resources

ROOT = Path(__file__).resolve().parents[1]

BAD = [  # (overrides, key the message must name, a phrase of the problem or fix)
    (["trainer.lrr=1"], "trainer.lrr", "did you mean 'trainer.lr'"),
    (["+trainer.lrr=1"], "trainer.lrr", "did you mean 'trainer.lr'"),
    (["trainers.lr=1"], "trainers", "did you mean 'trainer'"),
    (["trainer.lr=abc"], "trainer.lr", "expected float, got 'abc'"),
    (["trainer.total_steps=1.5"], "trainer.total_steps", "expected int"),
    (["rollout.enable_prefix_caching=maybe"], "rollout.enable_prefix_caching", "expected bool"),
    (["trainer.lr=-1"], "trainer.lr", "> 0"),
    (["trainer.lr=nan"], "trainer.lr", "finite"),
    (["algorithm.kl_estimator=k2"], "algorithm.kl_estimator", "low_var_kl"),
    (["algorithm.clip_eps_low=1.5"], "algorithm.clip_eps_low", "[0, 1)"),
    (["algorithm.mask_truncated=maybe"], "algorithm.mask_truncated", "expected bool"),
    (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
    (["rollout.temperature=0"], "rollout.temperature", "> 0"),
    (["rollout.max_tokens=5000"], "rollout.max_tokens", "rollout.max_model_len=1024"),
    (["rollout.max_model_len=4096"], "rollout.max_model_len", "max_position_embeddings=2048"),
    (["rollout.max_num_batched_tokens=8"], "rollout.max_num_batched_tokens", "max_num_seqs"),
    (["data.path=data/addition.csv"], "data.path", ".csv"),
    (["data.layout=gsm8k"], "data.layout", "data.generate=addition writes the dapo layout"),
    (["data.samples_per_prompt=1"], "data.samples_per_prompt", ">= 2"),
    (["model.tiny.num_kv_heads=3"], "model.tiny.num_kv_heads", "divide"),
    (["model.tiny.warmstart_rows=10"], "model.tiny.warmstart_rows", "64"),
    (["reward.fn=not_registered"], "reward.fn", "module:function"),
    (["reward.fn=no_such_module:f"], "reward.fn", "not importable"),
    (["reward.fn=vime.data.rewards:nope"], "reward.fn", "defines no 'nope' at its top level"),
    (["reward.timeout_s=0"], "reward.timeout_s", "> 0"),
    (["hydra.run.dir=/tmp/x"], "hydra.run.dir", "run.output_dir"),
    (["trainer.profile_update=500"], "trainer.profile_update", "trainer.total_steps=80"),
    (["trainer.tp=2", "run.executor=inprocess"], "trainer.tp", "need the Ray executor"),
    (["trainer.cp=2", "run.executor=inprocess"], "trainer.cp", "need the Ray executor"),
    (["trainer.token_segments=3"], "trainer.token_segments", "power of two"),
    (["trainer.cp=4", "trainer.token_segments=2", "run.executor=ray"], "trainer.token_segments", "multiple of trainer.cp=4"),
    (["trainer.token_segments=2", "rlkernel.mode=native"], "trainer.token_segments", "strict contract"),
    (["trainer.token_segments=2", "algorithm.entropy_coef=0.01"], "trainer.token_segments", "entropy bonus"),
    (["trainer.micro_batch_tokens=-1"], "trainer.micro_batch_tokens", ">= 0"),
    (["rollout.num_engines=2", "run.executor=inprocess"], "rollout.num_engines", "need the Ray executor"),
    (["resources.nodes=2"], "resources.nodes", "every role on this node"),
    (["resources.gpus=2", "resources.nodes=2"], "resources.nodes", "loopback only"),
    (["run.call_timeout_s=0"], "run.call_timeout_s", "> 0"),
    (["trainer.pp=2"], "trainer.pp", "pipeline"),
    (["resources.gpus=-1"], "resources.gpus", ">= 0"),
    (["resources.gpus=4", "trainer.tp=4", "trainer.cp=2"], "resources.gpus", "needs 8 GPUs"),
    (["resources.gpus=4", "resources.colocate=false", "trainer.tp=4", "rollout.tp=2"], "resources.gpus", "needs 6 GPUs"),
    (["algorithm.use_rollout_logprobs=true", "algorithm.tis_cap=2"], "algorithm.tis_cap", "use_rollout_logprobs=false"),
    (["resources.gpus=2", "trainer.tp=2", "algorithm.entropy_coef=0.01"], "algorithm.entropy_coef", "trainer.tp=1"),
    (["rollout.weight_sync=nccl"], "rollout.weight_sync", "auto, handles or host"),
    (["rollout.weight_sync=handles", "run.executor=inprocess"], "rollout.weight_sync", "need the Ray executor"),
    (["rollout.weight_sync=handles", "run.executor=ray", "rollout.tp=2"], "rollout.weight_sync", "a trainer rank on every engine device"),
    (["rollout.weight_sync=handles", "run.executor=ray", "resources.gpus=2", "resources.colocate=false"], "rollout.weight_sync",
     "must share the trainer's GPUs"),
    (["rlkernel.ops.attention=fa3"], "rlkernel.ops.attention", "runs on GPUs only"),
    (["resources.gpus=1", "rlkernel.ops.attention=fa3"], "rlkernel.ops.attention", "bf16 only here"),
    (["resources.gpus=2", "model.dtype=bfloat16", "trainer.cp=2", "run.executor=ray", "rlkernel.ops.attention=fa3"],
     "rlkernel.ops.attention", "not proven under context parallelism"),
]


@pytest.mark.parametrize("overrides,key,phrase", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_names_key_and_fix(overrides, key, phrase):
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tiny", overrides)
    msg = str(e.value)
    assert msg.startswith(f"{key}:") and "Fix:" in msg and phrase in msg, msg


def test_misspelled_key_in_a_recipe_file(tmp_path):
    text = (RECIPES / "grpo_tiny.yaml").read_text().replace("  max_num_seqs:", "  max_num_seq:")
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"^rollout\.max_num_seq: unknown key .*Fix: did you mean 'rollout\.max_num_seqs'"):
        load_config("typo", recipes=tmp_path)


def test_train_stops_before_any_model_is_built(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vime.cli", "train", "--config-name", "grpo_tiny", f"run.output_dir={tmp_path / 'run'}",
                           f"model.path={tmp_path / 'model'}", f"data.path={tmp_path / 'd.parquet'}", "trainer.lr=-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "trainer.lr: must be a finite number > 0, got -1.0. Fix:" in proc.stderr
    assert not any(tmp_path.iterdir()) and time.monotonic() - t0 < 60  # no model, no data, no run directory


def test_unshardable_tp_checked_before_loading(tmp_path):
    """trainer.tp=4 on the tiny model (2 KV heads): refused at preflight, naming the field and the reason."""
    cfg, _ = load_config("grpo_tiny", [f"model.path={tmp_path / 'model'}", f"data.path={tmp_path / 'd.parquet'}", "trainer.tp=4"])
    with pytest.raises(PreflightError, match=r"trainer\.tp=4 cannot shard this model: .*kv heads 2"):
        check_resources(cfg)
    cfg, _ = load_config("grpo_tiny", [f"model.path={tmp_path / 'model'}", f"data.path={tmp_path / 'd.parquet'}", "trainer.tp=2"])
    check_resources(cfg)  # TP=2 shards it


def test_rollout_tp_layout_checked_before_loading(tmp_path):
    """rollout.tp: the strict vLLM model shards like the trainer (heads, KV heads, canonical segments), so a size that
    does not divide the tiny model (2 KV heads) is refused at preflight, naming the field; one that does is accepted,
    as is any size for the native arm's stock engine (vLLM's own layers decide there)."""
    base = [f"model.path={tmp_path / 'model'}", f"data.path={tmp_path / 'd.parquet'}"]
    cfg, _ = load_config("grpo_tiny", base + ["rollout.tp=4"])
    with pytest.raises(PreflightError, match=r"rollout\.tp=4 cannot shard this model: .*kv heads 2"):
        check_resources(cfg)
    check_resources(load_config("grpo_tiny", base + ["rollout.tp=2"])[0])


def test_model_length_checked_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    cfg, _ = load_config("grpo_tiny", [f"model.path={tmp_path}", "model.init=existing", "data.generate=addition"])
    with pytest.raises(PreflightError, match=r"rollout\.max_model_len=1024 exceeds the model's max_position_embeddings=512"):
        check_resources(cfg)


def test_malformed_rows_are_quarantined_with_reasons(tmp_path):
    from vime.controller import prepare
    from vime.tiny_model import make_tiny_checkpoint

    good = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "reward_model": {"ground_truth": str(i + 1)}} for i in range(5)]
    bad = [
        {"reward_model": {"ground_truth": "1"}},  # no prompt
        {"prompt": [{"role": "user", "content": "  "}], "reward_model": {"ground_truth": "1"}},  # empty prompt
        {"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": ""}},  # no ground truth
        {"prompt": [{"role": "user", "content": "1+1="}]},  # no reward_model at all
        {"prompt": "x" * 200, "reward_model": {"ground_truth": "1"}},  # longer than 64 - 8 tokens
        {"prompt": "y" * 200, "reward_model": {"ground_truth": "1"}},
        {"prompt": "z" * 30, "reward_model": {"ground_truth": "1"}},  # fits the model, not vLLM-CPU's 16-token chunk budget
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    model = make_tiny_checkpoint(tmp_path / "model", vocab_size=128, seed=0)
    cfg, _ = load_config("grpo_tiny", [f"model.path={model}", "model.init=existing", f"data.path={data}", "data.generate=",
                                       "rollout.max_model_len=64", "rollout.max_num_batched_tokens=16", f"run.output_dir={tmp_path / 'run'}"])
    _, prompts, report = prepare(cfg, tmp_path / "run")
    assert len(prompts) == report.kept == 5 and report.rows == 12 and report.skipped == 7
    assert report.quarantined == {"missing_field:prompt": 1, "empty_prompt": 1, "missing_ground_truth": 1,
                                  "missing_field:reward_model.ground_truth": 1, "prompt_too_long": 2, "prompt_exceeds_chunk_budget": 1}
    assert json.loads((tmp_path / "run" / "data_report.json").read_text())["quarantined"] == report.quarantined
    with pytest.raises(ValueError, match="row 5 is malformed.*missing_field:prompt"):
        load_prompts(data, "dapo", strict=True)


def test_reward_failures_are_counted_never_silent(capsys):
    """Each failure is counted by kind; the first of each kind is shown with its cause (the exception and its frames,
    or what came back); a numpy scalar is a number."""
    worker = RewardWorker("faulty_rewards:by_text", timeout_s=1.0)
    try:
        t0 = time.monotonic()
        res = worker.score([("7", "7"), ("raise", "7"), ("hang", "7"), ("7", "7"), ("nan", "7"), ("none", "7"), ("exit", "7"), ("8", "7"),
                            ("raise", "7"), ("np32", "7"), ("array", "7")])
        took = time.monotonic() - t0
    finally:
        worker.close()
    assert [r.status for r in res] == ["ok", "raised:ValueError", "timeout", "ok", "not_a_number", "not_a_number", "worker_died", "ok",
                                       "raised:ValueError", "ok", "not_a_number"]
    assert [r.value for r in res] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    assert took < 30  # the hang cost one timeout, not an hour
    err = capsys.readouterr().err
    assert err.count("(raised:ValueError;") == 1 and "raised ValueError: reward bug" in err and "faulty_rewards.py" in err
    assert err.count("(not_a_number;") == 1 and "returned float nan, not a finite number" in err


def test_default_reward_runs_in_the_worker():
    worker = RewardWorker("math_verify", timeout_s=15.0)
    try:
        res = worker.score([("Answer: 7", "7"), ("so... Answer: 1/2", "0.5"), ("Answer: 8", "7"), ("Answer: }}}{{\\frac", "7")])
    finally:
        worker.close()
    assert [(r.value, r.status) for r in res] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok"), (0.0, "ok")]
    with pytest.raises(RuntimeError, match="reward.fn 'faulty_rewards:missing'.*did not start.*AttributeError"):
        RewardWorker("faulty_rewards:missing", timeout_s=1.0).score([("a", "b")])
