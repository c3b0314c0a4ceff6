"""scripts/round_probe.py (what a benchmark round cost besides wall time) and its use in bench_rollout --paired."""
from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from round_probe import RoundProbe, parse_smi  # noqa: E402

_BURN = ("import os, sys\n"
         "x = 0\n"
         "for i in range(3_000_000):\n"
         "    x += i * i\n"
         "t = os.times()\n"
         "print(t.user + t.system, flush=True)\n"
         "sys.stdin.readline()\n")


def test_a_live_descendants_cpu_time_is_counted():
    """A child that burns CPU and stays alive: the probe's CPU seconds include at least what the child reports for
    itself (its own os.times()), so an engine core's host work shows in a round's figure."""
    with RoundProbe(gpu=False) as probe:
        child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        own = float(child.stdout.readline())
    try:
        rep = probe.report(tokens=2000)
    finally:
        child.communicate("\n", timeout=60)
    assert own > 0
    assert rep["cpu_seconds"] >= own - 0.02, (rep, own)  # psutil and os.times read the same kernel counters (10 ms ticks)
    # per 1,000 tokens of the 2,000 the round made: at least half the child's own CPU milliseconds (checked against the
    # child's os.times, not against the probe's own formula)
    assert rep["cpu_ms_per_1k_tokens"] >= 1000 * (own - 0.02) / 2, (rep, own)
    assert 0.0 <= rep["host_busy"] <= 1.0
    assert "gpu" not in rep  # gpu=False: not sampled, not claimed


def test_garbage_collections_in_the_round_are_counted():
    with RoundProbe(gpu=False) as probe:
        gc.collect()
        gc.collect(0)
    rep = probe.report()
    assert rep["gc"]["collections"] >= 2 and rep["gc"]["oldest"] >= 1, rep
    with RoundProbe(gpu=False) as quiet:
        pass
    assert quiet.report()["gc"]["collections"] <= 1  # an empty body: at most an automatic young collection
    assert quiet._gc_cb not in gc.callbacks and probe._gc_cb not in gc.callbacks  # removed on exit


def test_nvidia_smi_lines_parse_and_its_absence_is_said():
    text = "1980, 312.45, 97\n1755, 290.10, 88\n[N/A], 300.00, 90\nnot a sample\n"
    rec = parse_smi(text)
    assert rec["samples"] == 3
    assert rec["clocks.sm"] == {"mean": 1867.5, "min": 1755.0}
    assert rec["power.draw"]["min"] == 290.1 and rec["utilization.gpu"]["mean"] == 91.7
    assert parse_smi("") == {"samples": 0}
    with RoundProbe() as probe:
        pass
    gpu = probe.report()["gpu"]
    if shutil.which("nvidia-smi") is None:
        assert gpu == {"absent": "nvidia-smi not found"}
    else:  # a GPU machine: sampled (possibly no sample in an empty body, but the parser ran)
        assert "samples" in gpu


def test_bench_rollout_paired_records_a_probe_per_engine_per_round(tmp_path):
    """bench_rollout --paired on the CPU (two vLLM-CPU engines alive at once, a tiny model, one round): every round
    carries both engines' probes, so a GPU session's slow rounds can be told apart by what they cost."""
    pytest.importorskip("vllm")
    from vime.tiny_model import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m", arch="qwen3", head_dim=32, init_std=0.08, seed=1)
    out = tmp_path / "paired.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_rollout.py"), "--model", str(model), "--num-prompts", "4",
                        "--prompt-len", "8", "--max-tokens", "8", "--rounds", "1", "--paired", "--engines", "stock,strict",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.loads(out.read_text())
    (rnd,) = res["rounds_detail"]
    assert set(rnd["probes"]) == {"stock", "strict"}
    for w, probe in rnd["probes"].items():
        assert probe["cpu_seconds"] > 0 and probe["cpu_ms_per_1k_tokens"] > 0, (w, probe)
        assert "gpu" in probe
    assert "cpu" in p.stdout.split("round 1", 1)[1].splitlines()[0]  # the round's line says what it cost
