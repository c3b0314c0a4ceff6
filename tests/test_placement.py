"""Claim: on GPUs each role process sees exactly its devices. `gpu_placement` hands each trainer rank one GPU and
each vLLM engine rollout.tp GPUs (colocated: the same devices as the trainer; else the next ones), indexing into
the driver's CUDA_VISIBLE_DEVICES; the Ray executor gives an actor its own variables (the mechanism the placement
uses — Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for actors that ask it for no GPUs), checked here in real Ray
actors on the CPU. The GPU loop itself ran on an H200: scripts/gpu_loop.py, benchmarks/h200_loop_*.json."""
import os

import pytest

from vime.config import load_config
from vime.roles import default_enforce_eager, gpu_memory_utilization, gpu_placement, handles_for_engines, ipc_weight_sync
from helpers import last_json


def test_cpu_recipes_place_nothing():
    cfg, _ = load_config("grpo_tiny")
    assert gpu_placement(cfg) == {} and gpu_memory_utilization(cfg) is None and not ipc_weight_sync(cfg)
    assert default_enforce_eager(cfg)  # no CUDA graphs on the CPU


def test_cuda_graphs_by_default_on_gpus_where_proved():
    assert not default_enforce_eager(load_config("grpo_qwen3_gpu")[0])  # strict, rollout TP=1: decode graphs
    assert not default_enforce_eager(load_config("grpo_qwen3_gpu", ["rlkernel.mode=native"])[0])  # stock: vLLM's default
    assert default_enforce_eager(load_config("grpo_qwen3_8b")[0])  # strict engines at TP=4: eager
    assert not default_enforce_eager(load_config("grpo_qwen3_8b", ["rlkernel.mode=native"])[0])


def test_strict_graphs_at_rollout_tp_above_one_are_refused(tmp_path, monkeypatch):
    from vime.rollout import RolloutConfig

    (tmp_path / "config.json").write_text("{}")
    RolloutConfig(model=str(tmp_path), engine="rlkernel", tp=1, enforce_eager=False)
    RolloutConfig(model=str(tmp_path), engine="stock", tp=2, enforce_eager=False, block_size=32)
    with pytest.raises(ValueError, match="rollout.enforce_eager=true"):
        RolloutConfig(model=str(tmp_path), engine="rlkernel", tp=2, enforce_eager=False)
    monkeypatch.setenv("VIME_STRICT_TP_GRAPHS", "1")  # the experiment that would prove them (two GPUs)
    RolloutConfig(model=str(tmp_path), engine="rlkernel", tp=2, enforce_eager=False)


def test_engine_args_must_be_named_pairs(tmp_path):
    """RolloutConfig.engine_args (extra vllm.LLM arguments for experiments, applied last and recorded in provenance)
    takes (name, value) pairs; anything else is refused before an engine is built."""
    from vime.rollout import RolloutConfig

    (tmp_path / "config.json").write_text("{}")
    RolloutConfig(model=str(tmp_path), engine_args=(("logprobs_mode", "raw_logprobs"),))
    for bad in (("logprobs_mode",), (("logprobs_mode", "raw_logprobs", 1),), ((1, "x"),)):
        with pytest.raises(ValueError, match="engine_args must be"):
            RolloutConfig(model=str(tmp_path), engine_args=bad)


def test_one_gpu_colocated_shares_the_device_and_syncs_by_ipc():
    cfg, _ = load_config("grpo_qwen3_gpu")
    assert gpu_placement(cfg, visible="") == {"trainer": ["0"], "engines": ["0"]}
    assert gpu_placement(cfg, visible="5") == {"trainer": ["5"], "engines": ["5"]}  # the driver's own visible device
    assert gpu_memory_utilization(cfg) == 0.45 and ipc_weight_sync(cfg)
    native, _ = load_config("grpo_qwen3_gpu", ["rlkernel.mode=native"])
    assert ipc_weight_sync(native)  # stock vLLM too: the handles are opened beside it and fed to its own reload
    assert not ipc_weight_sync(load_config("grpo_qwen3_gpu", ["resources.colocate=false", "resources.gpus=2"])[0])
    assert not ipc_weight_sync(load_config("grpo_qwen3_gpu", ["rollout.weight_sync=host"])[0])  # asked for the host path
    assert gpu_memory_utilization(load_config("grpo_qwen3_gpu", ["rollout.gpu_memory_utilization=0.3"])[0]) == 0.3


def test_eight_gpu_layouts():
    cfg, _ = load_config("grpo_qwen3_8b")  # TP4 x CP2 trainer, two engines at TP4, colocated
    assert gpu_placement(cfg, visible="") == {"trainer": [str(i) for i in range(8)], "engines": ["0,1,2,3", "4,5,6,7"]}
    assert ipc_weight_sync(cfg)  # every engine worker's GPU holds a trainer rank: each opens that rank's handles
    payloads = [{"device": f"cuda:{g}", "rank": g, "handles": {}} for g in range(8)]
    assert [[p["rank"] for p in e] for e in handles_for_engines(payloads, 2, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="need as many trainer ranks' handles, got 4"):
        handles_for_engines(payloads[:4], 2, 4)
    assert not ipc_weight_sync(load_config("grpo_qwen3_8b", ["trainer.cp=1"])[0])  # 4 ranks for 8 engine workers: host
    assert ipc_weight_sync(load_config("grpo_qwen3_8b", ["rollout.num_engines=1"])[0])  # 4 workers on ranks 0-3's GPUs
    apart, _ = load_config("grpo_qwen3_8b", ["resources.colocate=false", "resources.gpus=16"])
    assert gpu_placement(apart, visible="")["engines"] == ["8,9,10,11", "12,13,14,15"]
    with pytest.raises(ValueError, match="needs 8 GPUs but 4 are visible"):
        gpu_placement(cfg, visible="0,1,2,3")


def test_engine_worker_refuses_handles_from_another_device():
    """An engine worker opens only the handles a trainer rank made on its own device (pick_handles): a payload from
    another GPU (a layout that does not colocate them in gpu_placement's order) is refused, naming both devices and
    the fix, instead of opening a handle that is not there or copying the wrong rank's tensors."""
    from rlkernel.integrations.vllm_worker import device_ident, pick_handles

    here = device_ident("cpu")
    mine = {"device": here, "rank": 3, "handles": {"w": "h"}}
    assert pick_handles([{"device": "cuda:GPU-other", "rank": 2, "handles": {}}, mine], 1, "cpu") == {"w": "h"}
    with pytest.raises(RuntimeError, match=r"TP rank 0 is on cpu:.* from trainer rank 2 on cuda:GPU-other.*rollout.weight_sync=host"):
        pick_handles([{"device": "cuda:GPU-other", "rank": 2, "handles": {}}, mine], 0, "cpu")
    with pytest.raises(RuntimeError, match="TP rank 2 got handles for 2 worker"):
        pick_handles([mine, mine], 2, "cpu")


def test_bad_memory_fraction_is_refused():
    with pytest.raises(Exception, match="rollout.gpu_memory_utilization"):
        load_config("grpo_qwen3_gpu", ["rollout.gpu_memory_utilization=1.5"])


def test_ray_actor_gets_its_own_environment():
    from vime.executor import RayExecutor

    class _Probe:  # local: Ray ships it by value (the test module is not importable in a worker)
        def env(self, key):
            return os.environ.get(key)

    ex = RayExecutor(num_roles=2)
    try:
        a = ex.spawn(_Probe, name="a", env={"CUDA_VISIBLE_DEVICES": "3"})
        b = ex.spawn(_Probe, name="b")
        assert a.call("env", "CUDA_VISIBLE_DEVICES") == "3"
        assert a.call("env", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"  # the job's variables stay
        assert b.call("env", "CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    finally:
        ex.shutdown()


def test_gpu_loop_script_streams_each_arm_to_its_out_dir(tmp_path):
    """scripts/gpu_loop.py (the H200 loop's driver) on the CPU recipe: the arm's output and metrics lines land in --out
    as the arm runs (a device call cut short keeps them), and the report reads them: 2 strict steps at mismatch 0; the
    arms' update profiles (trainer.profile_update) land in one file, so a two-arm call stays within the tool's 8 files."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_loop.py"), "--allow-cpu", "--config-name", "grpo_tiny",
                           "--steps", "2", "--arms", "strict", "--out", str(out), "--runs", str(tmp_path / "runs"),
                           "strict:trainer.profile_update=1", "strict:run.seed=7", "native:run.seed=9"],  # overrides for one arm only
                          capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "h200_loop_grpo_tiny_strict.log").read_text()
    assert log.startswith("$ ") and "vime.cli train --config-name grpo_tiny rlkernel.mode=strict" in log
    command = log.splitlines()[0]
    assert command.endswith(" run.seed=7") and "run.seed=9" not in command and "strict:" not in command
    lines = [json.loads(x) for x in (out / "h200_loop_grpo_tiny_strict_metrics.jsonl").read_text().splitlines()]
    assert [x["mismatch_count"] for x in lines] == [0, 0]
    report = last_json(proc.stdout)
    assert report["arms"]["strict"]["steps"] == 2 and report["strict_zero_mismatch_every_step"] is True
    assert report["overrides"] == {"strict": ["trainer.profile_update=1", "run.seed=7"]} and report["parallel"] is False
    # every arm's update profiles in one file (the device tool returns at most 8 files a call), summarised in the report
    profiles = json.loads((out / "h200_loop_grpo_tiny_update_profiles.json").read_text())
    assert list(profiles) == ["strict"] and list(profiles["strict"]) == ["update_step_000001"]
    assert profiles["strict"]["update_step_000001"]["wall_seconds"] > 0
    assert report["arms"]["strict"]["update_profiles"]["update_step_000001"]["wall_seconds"] == \
        profiles["strict"]["update_step_000001"]["wall_seconds"]
    assert not list(out.glob("*_update_step_*.json"))
    # --parallel needs a GPU per arm, and an arm prefix must name an arm: both refused before anything runs
    for extra, why in ((["--parallel"], "2 arms to run, 0 GPUs here"), (["strcit:run.seed=7"], "the prefix must be an arm")):
        bad = subprocess.run([sys.executable, str(root / "scripts" / "gpu_loop.py"), "--allow-cpu", "--config-name", "grpo_tiny",
                              "--arms", "strict,native", "--out", str(tmp_path / "bad"), "--runs", str(tmp_path / "runs"), *extra],
                             capture_output=True, text=True, timeout=300, cwd=root)
        assert bad.returncode != 0 and why in bad.stderr, bad.stderr[-2000:]
        assert not (tmp_path / "bad" / "h200_loop_grpo_tiny_strict.log").exists()  # nothing started


def test_gpu_loop_succeeds_when_every_arm_ran_and_a_strict_arm_is_exact():
    """gpu_loop.verdict: a native arm alone (its mismatches are the point) succeeds by running all its steps (session
    36's call 8 exited 1 for want of a strict arm); a strict arm with a mismatch, a nonzero |diff|, a step not
    comparable, a short run, or a failed native arm beside it fails the script."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_loop

    def arm(rc=0, steps=3, comparable=True, mismatch=(0, 0, 0), diff=(0.0, 0.0, 0.0)):
        return {"rc": rc, "steps": steps, "comparable": comparable, "mismatch_count": list(mismatch),
                "max_abs_diff": list(diff)}

    native = arm(mismatch=(300, 310, 290), diff=(0.05, 0.06, 0.04))
    assert gpu_loop.verdict({"native": native}, 3) == (None, True)
    assert gpu_loop.verdict({"native": arm(steps=2)}, 3) == (None, False)
    assert gpu_loop.verdict({"strict": arm(), "native": native}, 3) == (True, True)
    assert gpu_loop.verdict({"strict": arm(), "native": arm(rc=1, steps=1)}, 3) == (True, False)
    for bad in (arm(mismatch=(0, 1, 0)), arm(diff=(0.0, 1e-7, 0.0)), arm(comparable=False), arm(steps=2), arm(rc=1)):
        assert gpu_loop.verdict({"strict": bad}, 3) == (False, False)


def test_gpu_loop_brings_back_each_arms_kernel_manifests_in_one_file(tmp_path):
    """scripts/gpu_loop.py's kernel_manifests: the compile-ahead manifests a GPU arm's trainer and strict engines
    record in its run directory (triton_kernels.json, triton_kernels_vllm-0.json) are read back per arm, so that the
    report's one file carries them off the device machine; a half-written one is named, not fatal; files that are not
    manifests (a writer's temporary, the metrics) are left out."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_loop

    strict, native = tmp_path / "strict", tmp_path / "native"
    strict.mkdir()
    native.mkdir()
    doc = {"entries": [{"kernel": "k", "key": "a", "seconds": 1.0, "data": {}}, {"kernel": "k", "key": "b", "seconds": None, "data": {}}]}
    (strict / "triton_kernels.json").write_text(json.dumps(doc))
    (strict / "triton_kernels_vllm-0.json").write_text("{\"entries\": [")  # cut off mid-write
    (strict / "triton_kernels.json.tmp123").write_text("{}")
    (strict / "metrics.jsonl").write_text("{}\n")
    got = gpu_loop.kernel_manifests({"strict": {"run_dir": str(strict)}, "native": {"run_dir": str(native)}})
    assert list(got) == ["strict"] and sorted(got["strict"]) == ["triton_kernels.json", "triton_kernels_vllm-0.json"]
    assert got["strict"]["triton_kernels.json"] == doc
    assert "unreadable" in got["strict"]["triton_kernels_vllm-0.json"]
