#!/usr/bin/env python3
"""The whole loop on a GPU, both arms of one recipe, side by side: `vime train` strict, then native.

    python3 scripts/gpu_loop.py --config-name grpo_qwen3_gpu [--steps 20] [--out DIR] [--parallel] [override ...]

An override `key=value` goes to every arm (`rlkernel.ops.attention=fa3` in the native arm too makes that arm the
ablation "native but FA3 attention on both sides", not production); `ARM:key=value` to that arm only
(`strict:rlkernel.ops.attention=fa3`). --parallel runs the arms at the same time, arm i alone on GPU i
(CUDA_VISIBLE_DEVICES, its own Ray temp dir), after the recipe's model is built once: two arms in the time of one
on a two-GPU machine; the report says so (`parallel`), as the arms then share the host's CPUs.

Each arm is a real `vime train` run (Ray actors: vLLM on CUDA, the Megatron-core trainer on CUDA, colocated
on the recipe's GPUs), in RUNS/<recipe>_<arm>. Afterwards, to DIR ($OUT, else benchmarks/): <tag>.json with
per-step mismatch_count, max_abs_diff, contracts_match, step / rollout / score / update / sync times and
tokens/s per arm, and the ratios strict/native (median over the steps after the first, which include
compilation and caches); <tag>_curves.png (`vime plot` of both runs); <tag>_<arm>_metrics.jsonl (copied while
the arm runs, with its output in <tag>_<arm>.log: a call cut short keeps both); <tag>_kernel_manifests.json (the
strict arm's compile-ahead manifests, when it recorded any: point trainer.kernel_manifest at one to start warm). Prints
the summary JSON last. Exit status 1 when an arm did not run all its steps, or the strict arm (if asked) had any
mismatch or a step that was not comparable; a native arm alone succeeds by running (its mismatches are the point).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _reused(recipe: str, arm: str, runs: Path) -> dict:
    """An arm a previous call of this script ran on this machine (its run directory is still there): its lines, not
    re-run — a device call is limited to 10 minutes, so the two arms of a large recipe can take two calls."""
    run_dir = runs / f"{recipe}_{arm}"
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise SystemExit(f"--reuse {arm}: no {metrics} (run that arm first, on this machine)")
    meta = json.loads((run_dir / "gpu_loop_arm.json").read_text()) if (run_dir / "gpu_loop_arm.json").exists() else {}
    return {"run_dir": str(run_dir), "rc": meta.get("rc", 0), "wall_seconds": meta.get("wall_seconds"), "reused": True,
            "lines": [json.loads(x) for x in metrics.read_text().splitlines()], "log_tail": ""}


def arm_overrides(overrides: list[str], arm: str) -> list[str]:
    """The overrides one arm runs: every plain `key=value`, and `ARM:key=value` of this arm (without the prefix)."""
    mine = []
    for o in overrides:
        head, sep, rest = o.partition(":")
        if sep and "=" not in head:  # "strict:key=value" (a plain value may hold a colon: "key=a:b")
            if head not in ("strict", "native"):
                raise SystemExit(f"override {o!r}: the prefix must be an arm (strict: or native:), got {head!r}")
            if head == arm:
                mine.append(rest)
        else:
            mine.append(o)
    return mine


def _start(recipe: str, arm: str, steps: int, runs: Path, overrides: list[str], log_path: Path, env: dict | None = None) -> dict:
    """Start one arm as a real `vime train` run (`_wait` follows it)."""
    run_dir = runs / f"{recipe}_{arm}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "vime.cli", "train", "--config-name", recipe, f"rlkernel.mode={arm}", f"trainer.total_steps={steps}",
           f"run.output_dir={run_dir}", "logging.progress=false", *arm_overrides(overrides, arm)]
    log = open(log_path, "w")
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    return {"proc": proc, "log": log, "log_path": log_path, "run_dir": run_dir, "t0": time.perf_counter()}


def _arm(recipe: str, arm: str, steps: int, runs: Path, overrides: list[str], log_path: Path) -> dict:
    """One arm as a real `vime train` run. Its output goes to `log_path` (under --out) as it runs, and its metrics
    lines are copied beside it every few seconds (`<log>_metrics.jsonl`, the name the report then rewrites), so a
    device call cut short (the 10-minute limit, the session's budget) still brings back how far the run got."""
    return _wait(_start(recipe, arm, steps, runs, overrides, log_path))


def _wait(started: dict) -> dict:
    proc, log, log_path, run_dir, t0 = (started[k] for k in ("proc", "log", "log_path", "run_dir", "t0"))
    partial = log_path.with_name(log_path.stem + "_metrics.jsonl")
    while True:
        try:
            rc = proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            if (run_dir / "metrics.jsonl").exists():
                shutil.copyfile(run_dir / "metrics.jsonl", partial)
    log.close()
    wall = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    print(text[-4000:], flush=True)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if (run_dir / "metrics.jsonl").exists() else []
    if run_dir.exists():
        (run_dir / "gpu_loop_arm.json").write_text(json.dumps({"rc": rc, "wall_seconds": round(wall, 1)}))
    return {"run_dir": str(run_dir), "rc": rc, "wall_seconds": round(wall, 1), "lines": lines, "log_tail": text[-6000:] if rc else ""}


def _await_model(recipe: str, overrides: list[str], first: dict) -> None:
    """The arms share the recipe's model directory: when the first arm builds it (model.init=tiny_sft), the others
    start only once it is complete (its vime_warmstart.json written last), so none reads it half-written."""
    from vime.config import load_config

    cfg, _ = load_config(recipe, overrides)
    if cfg.model.init != "tiny_sft":
        return
    model = Path(cfg.model.path)
    done = (model if model.is_absolute() else ROOT / model) / "vime_warmstart.json"
    while not done.exists():
        if first["proc"].poll() is not None:
            raise SystemExit(f"the first arm ended (rc {first['proc'].returncode}) before building {cfg.model.path}: see {first['log_path']}")
        time.sleep(2)


def _summary(a: dict) -> dict:
    lines = a["lines"]
    later = lines[1:] or lines

    def med(key):
        vals = [x[key] for x in later if x.get(key) is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {
        "rc": a["rc"], "steps": len(lines), "wall_seconds": a["wall_seconds"], "reused": a.get("reused", False),
        "mismatch_count": [x["mismatch_count"] for x in lines], "max_abs_diff": [x["max_abs_diff"] for x in lines],
        "compared_tokens": sum(x["compared_tokens"] for x in lines), "comparable": bool(lines) and all(x["comparable"] for x in lines),
        "contracts_match": [x.get("contracts_match") for x in lines], "reward_mean": [round(x["reward_mean"], 4) for x in lines],
        "median_seconds": {k: med(f"time_{k}") for k in ("step", "rollout", "score", "update", "sync")},
        "median_tokens_per_second": med("tokens_per_second"),
        "first_step_seconds": round(lines[0]["time_step"], 2) if lines else None,
        # of it, the trainer's first launches of rlkernel's Triton kernels (compiling on a cold machine; None: native
        # or a run before this field)
        "first_step_compile_seconds": lines[0].get("time_compile") if lines else None,
        "compile_seconds_total": round(sum(x.get("time_compile") or 0.0 for x in lines), 2) if lines else None,
    }


def kernel_manifests(arms: dict) -> dict:
    """Every arm's compile-ahead manifests (trainer.kernel_manifest "auto": the run directory's triton_kernels.json and
    each strict engine's triton_kernels_<engine>.json), as {arm: {file name: its JSON}}: the kernels a cold machine
    compiled, brought back in one file (the device tool returns at most 8 files a call) so that a later run can be
    pointed at them (trainer.kernel_manifest=PATH compiles them ahead, in parallel, before the first step)."""
    out: dict = {}
    for arm, a in arms.items():
        for f in sorted(Path(a["run_dir"]).glob("triton_kernels*.json")):
            try:
                out.setdefault(arm, {})[f.name] = json.loads(f.read_text())
            except (OSError, ValueError) as e:  # a manifest being written as the call ended: say so, keep the rest
                out.setdefault(arm, {})[f.name] = {"unreadable": f"{type(e).__name__}: {e}"}
    return out


def _report(args, arms: dict, out: Path, tag: str, torch):
    from vime.stamp import code_stamp

    report = {"recipe": args.config_name, "overrides": {arm: arm_overrides(args.overrides, arm) for arm in arms},
              "parallel": bool(args.parallel), "steps_asked": args.steps, "code": code_stamp(),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "arms": {arm: _summary(a) for arm, a in arms.items()},
              "failures": {arm: a["log_tail"] for arm, a in arms.items() if a["rc"]}}
    s, n = report["arms"].get("strict"), report["arms"].get("native")
    if s and n and s["steps"] and n["steps"]:
        ratio = {k: round(s["median_seconds"][k] / n["median_seconds"][k], 3) if s["median_seconds"][k] and n["median_seconds"][k] else None
                 for k in s["median_seconds"]}
        step_wo_sync = [(x["time_step"] - x["time_sync"]) for x in arms["strict"]["lines"][1:]], \
                       [(x["time_step"] - x["time_sync"]) for x in arms["native"]["lines"][1:]]
        if all(step_wo_sync):
            ratio["step_without_sync"] = round(statistics.median(step_wo_sync[0]) / statistics.median(step_wo_sync[1]), 3)
        report["ratio_strict_over_native"] = ratio
    profiles = {}  # every arm's update profiles in one file: the device tool returns at most 8 files a call
    for arm, a in arms.items():
        if a["lines"]:
            (out / f"{tag}_{arm}_metrics.jsonl").write_text("\n".join(json.dumps(x) for x in a["lines"]) + "\n")
        for prof in sorted(Path(a["run_dir"]).glob("profile/update_step_*.json")):  # trainer.profile_update
            data = json.loads(prof.read_text())
            profiles.setdefault(arm, {})[prof.stem] = data
            report["arms"][arm].setdefault("update_profiles", {})[prof.stem] = {
                k: data.get(k) for k in ("wall_seconds", "device_kernel_ms", "device_kernels", "launch_calls", "host_waits", "memcpy_calls")}
    if profiles:
        (out / f"{tag}_update_profiles.json").write_text(json.dumps(profiles, indent=1))
    manifests = kernel_manifests(arms)
    if manifests:
        (out / f"{tag}_kernel_manifests.json").write_text(json.dumps(manifests))
        for arm, files in manifests.items():
            report["arms"][arm]["kernel_manifests"] = {name: len(m.get("entries", [])) for name, m in files.items()}
    dirs = [a["run_dir"] for a in arms.values() if a["lines"]]
    if dirs:
        p = subprocess.run([sys.executable, "-m", "vime.cli", "plot", *dirs, "--out", str(out / f"{tag}_curves.png")], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        report["plot"] = p.stdout.strip().splitlines()[-3:]
    report["strict_zero_mismatch_every_step"], ok = verdict(report["arms"], args.steps)
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1))
    return report, ok


def verdict(summaries: dict, steps: int) -> tuple[bool | None, bool]:
    """(strict_zero_mismatch_every_step: None without a strict arm, the script's success): every arm ran all `steps`
    with exit status 0, and a strict arm, if asked, compared every step at mismatch 0 and max |diff| 0."""
    def ran(a):
        return a["rc"] == 0 and a["steps"] == steps

    s = summaries.get("strict")
    strict_ok = None if s is None else bool(ran(s) and s["comparable"] and not any(s["mismatch_count"])
                                            and not any(s["max_abs_diff"]))
    return strict_ok, all(ran(a) for a in summaries.values()) and strict_ok is not False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-name", default="grpo_qwen3_gpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--arms", default="strict,native")
    ap.add_argument("--runs", default="/tmp/vime_gpu_runs", help="where the runs' directories go (checkpoints are large)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--tag", default=None, help="output name (default: h200_loop_<recipe>)")
    ap.add_argument("--reuse", default="", help="arms a previous call ran on this machine: read their run directories "
                    "instead of running them again (the two arms in two device calls)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (a CPU recipe; for smoke tests)")
    ap.add_argument("--parallel", action="store_true", help="run the arms at the same time, arm i on GPU i (one GPU per arm)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:  # the committed H200 figures are never overwritten by a CPU run
        print(json.dumps({"skipped": "no CUDA device (pass --allow-cpu to run the recipe's CPU loop anyway)"}))
        return 0

    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"h200_loop_{args.config_name}"
    arms: dict = {}
    names = args.arms.split(",")
    for arm in names:
        arm_overrides(args.overrides, arm)  # a bad prefix is refused before anything runs
    if args.parallel:
        fresh = [a for a in names if a not in args.reuse.split(",")]
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < len(fresh):
            raise SystemExit(f"--parallel runs each arm on its own GPU: {len(fresh)} arms to run, {have} GPUs here")
        started = {}
        for i, arm in enumerate(fresh):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), RAY_TMPDIR=f"/tmp/ray_{arm}")
            started[arm] = _start(args.config_name, arm, args.steps, runs, args.overrides, out / f"{tag}_{arm}.log", env)
            if i == 0:
                _await_model(args.config_name, arm_overrides(args.overrides, arm), started[arm])
        done = {arm: _wait(st) for arm, st in started.items()}
        for arm in names:
            arms[arm] = done[arm] if arm in done else _reused(args.config_name, arm, runs)
        report, ok = _report(args, arms, out, tag, torch)
    else:
        for arm in names:  # the report is rewritten after each arm: a device call cut short keeps what ran
            reuse = arm in args.reuse.split(",")
            arms[arm] = (_reused(args.config_name, arm, runs) if reuse else
                         _arm(args.config_name, arm, args.steps, runs, args.overrides, out / f"{tag}_{arm}.log"))
            report, ok = _report(args, arms, out, tag, torch)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
