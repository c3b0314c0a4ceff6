#!/usr/bin/env python3
"""Step time by phase, strict vs native, same recipe: runs `vime train` once per arm
(subprocesses, same seed and overrides), then prints the median of each phase and the ratio
strict/native from their metrics.jsonl, plus a JSON line. Extra arguments are Hydra overrides."""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("time_rollout", "time_score", "time_update", "time_sync", "time_step")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-name", default="grpo_tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (warm-up)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vime_bench_"))
    med = {}
    try:
        for arm in ("strict", "native"):
            out = root / arm
            cmd = [sys.executable, "-m", "vime.cli", "train", "--config-name", a.config_name, f"run.output_dir={out}", f"rlkernel.mode={arm}",
                   f"trainer.total_steps={a.steps}", "run.save_every=0", "logging.progress=false", "logging.wandb=false", *a.overrides]
            subprocess.run(cmd, check=True, capture_output=True)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][a.skip:]
            med[arm] = {p: statistics.median(r[p] for r in rows) for p in PHASES}
            med[arm]["mismatch_steps"] = sum(r["mismatch_count"] > 0 for r in rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'phase':<14} {'strict s':>9} {'native s':>9} {'strict/native':>14}")
    for p in PHASES:
        print(f"{p:<14} {med['strict'][p]:>9.3f} {med['native'][p]:>9.3f} {med['strict'][p] / med['native'][p]:>13.2f}x")
    print(json.dumps({"config": a.config_name, "steps": a.steps, "medians": med,
                      "ratio_step": round(med["strict"]["time_step"] / med["native"]["time_step"], 3)}))


if __name__ == "__main__":
    main()
