#!/usr/bin/env python3
"""The long run: N consecutive GRPO steps of a recipe (default 200 of `grpo_tiny`) in the
strict arm, every step compared and at `mismatch_count == 0`; the metrics and curves kept.

    python scripts/long_run.py [--steps 200] [--config-name grpo_tiny] [--out benchmarks] [overrides ...]

Runs `vime train` in a subprocess with `trainer.total_steps=N` and a fresh run directory, then
checks every metrics line (a step that was not compared counts as a failure, not a pass) and
writes OUT/cpu_long_run_<N>.jsonl (the run's metrics), OUT/cpu_long_run_<N>.json (the summary)
and OUT/cpu_long_run_<N>.png (the curves, `vime plot`). Exit status 1 when any step failed.
Not part of `make test` (minutes of CPU).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vime.stamp import code_stamp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--config-name", default="grpo_tiny")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="vime_long_")) / a.config_name
    cmd = [sys.executable, "-m", "vime.cli", "train", "--config-name", a.config_name, f"trainer.total_steps={a.steps}",
           f"run.output_dir={run_dir}", *a.overrides]
    print("running:", " ".join(cmd), flush=True)
    stamp, t0 = code_stamp(), time.time()  # the sources as the run starts (edits during it must not date it)
    proc = subprocess.run(cmd, cwd=ROOT)
    wall = time.time() - t0
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        print(f"the run failed (exit {proc.returncode}); metrics: {metrics.exists()}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    failed = [r["step"] for r in rows if r.get("mismatch_count") != 0 or r.get("max_abs_diff") != 0.0]
    missing = sorted(set(range(steps[0], steps[0] + a.steps)) - set(steps)) if steps else list(range(a.steps))
    rewards = [r.get("reward_mean") for r in rows if r.get("reward_mean") is not None]
    summary = {
        "config": a.config_name, "overrides": a.overrides, "steps_requested": a.steps, "steps_logged": len(rows),
        "missing_steps": missing, "steps_not_at_zero": failed,
        "compared_tokens": sum(int(r.get("compared_tokens") or 0) for r in rows),
        "mismatch_total": sum(int(r.get("mismatch_count") or 0) for r in rows),
        "reward_first10": sum(rewards[:10]) / max(1, len(rewards[:10])),
        "reward_last10": sum(rewards[-10:]) / max(1, len(rewards[-10:])),
        "wall_seconds": round(wall, 1), "ok": not failed and not missing and len(rows) == a.steps,
        "code": stamp,  # what this was measured with (scripts/stale_results.py), taken before the run started
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_long_run_{a.steps}"
    shutil.copyfile(metrics, stem.with_suffix(".jsonl"))
    subprocess.run([sys.executable, "-m", "vime.cli", "plot", str(run_dir)], cwd=ROOT, check=False)
    png = run_dir / "curves.png"
    if png.exists():
        shutil.copyfile(png, stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
