"""The opt-in FlashAttention 3 attention (rlkernel/backends/fa3.py) on a CPU-only machine: registered under its own
contract, refused here with the reason, selectable per op (also by the building blocks that ask for "strict"), accepted
by the config for attention only, and judged strict by a run's verdict. Its bits are checked on the GPU at load against
the committed golden (`python -m rlkernel.backends.fa3 --record` on an H200; benchmarks/h200_fa3_compare.json has the
properties at 22,501 tokens)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlkernel as rk
from rlkernel import dispatch
from rlkernel.backends import fa3
from rlkernel.contracts import gpu as G
from helpers import last_json

ROOT = Path(__file__).resolve().parents[1]


def test_registered_under_its_own_pinned_contract():
    impl = dispatch._REGISTRY[("attention", "fa3")]
    assert impl.contract is G.FA3_ATTENTION and impl.devices == ("cuda",)
    c = G.FA3_ATTENTION
    assert c.contract_id.startswith("attention/fa3-sm90/v1/") and c.contract_id != G.ATTENTION.contract_id
    assert ("num_splits", 1) in c.partition and any(G.FA3_VLLM in str(v) for _, v in c.partition)
    assert {d.field for d in rk.diff(G.ATTENTION, c)} >= {"partition", "merge"}  # predicted to differ from Triton's bits
    golden = json.loads(fa3.GOLDEN.read_text())  # shipped with the package, recorded on an H200 (device call 8, session 8)
    assert golden.get(f"{G.ARCH}|vllm {G.FA3_VLLM}"), golden  # the pinned arch and vLLM have their bits committed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refused_without_cuda_with_the_reason():
    assert fa3.unavailable_reason() == "no CUDA device" and not fa3.available()
    with rk.mode(ops={"attention": "fa3"}):
        with pytest.raises(rk.BackendUnavailable, match=r"'fa3'.*\(no CUDA device\)"):  # the reason, not just "no"
            dispatch.resolve("attention", torch.device("cuda"))
    out = subprocess.run([sys.executable, "-m", "rlkernel.backends.fa3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and last_json(out.stdout) == {"skipped": "needs a CUDA device and vLLM"}


def test_a_per_op_implementation_is_what_strict_building_blocks_get():
    """Building blocks (the CP attention, the vLLM backend's KV write) ask dispatch for "strict"; a per-op override that
    names an implementation pins that op's strict implementation for them too — here "reference" on the CPU, which runs."""
    cpu = torch.device("cpu")
    assert dispatch.resolve("attention", cpu, "strict").name == "cpu"
    with rk.mode(ops={"attention": "reference"}):
        assert dispatch.resolve("attention", cpu, "strict").name == "reference"
        assert dispatch.resolve("attention", cpu).name == "reference"
        assert dispatch.resolve("linear", cpu, "strict").name == "cpu"  # other ops keep theirs
        assert dispatch.resolve("attention", cpu, "native").name == "native"
    with rk.mode(ops={"attention": "fa3"}):
        with pytest.raises(rk.BackendUnavailable, match="does not run on cpu"):
            dispatch.resolve("attention", cpu, "strict")


def test_config_takes_fa3_for_attention_on_gpus_in_bf16_only():
    """Refused before anything starts where it cannot run (a CPU recipe, an fp32 model), with the key and the fix.
    (Hydra composes the recipes: `make install` has it; a bare GPU machine without the staged kit does not — session
    42's `gpu_tests` there failed on the import, not on the check.)"""
    pytest.importorskip("hydra")
    from vime.config import ConfigError, load_config

    cfg, _ = load_config("grpo_qwen3_gpu", ["rlkernel.ops.attention=fa3"])
    assert dict(cfg.rlkernel.side_ops("rollout")) == dict(cfg.rlkernel.side_ops("trainer")) == {"attention": "fa3"}
    with pytest.raises(Exception, match=r"rlkernel\.ops\.linear"):
        load_config("grpo_qwen3_gpu", ["rlkernel.ops.linear=fa3"])
    with pytest.raises(ConfigError, match=r"rlkernel\.ops\.attention.*GPUs only.*resources\.gpus>=1"):
        load_config("grpo_tiny", ["rlkernel.ops.attention=fa3"])
    with pytest.raises(ConfigError, match=r"rlkernel\.ops\.attention.*no float32 kernel.*model\.dtype=bfloat16"):
        load_config("grpo_qwen3_gpu", ["rlkernel.trainer_ops.attention=fa3", "model.dtype=float32"])


def test_a_step_on_fa3_is_strict():
    from vime.strictness import strict_status

    e = [{"backend": "fa3-sm90", "impl": "fa3", "contract_id": G.FA3_ATTENTION.contract_id, "device": "cuda", "calls": 3}]
    ops = {"rollout": (("attention", "fa3"),), "trainer": (("attention", "fa3"),)}
    assert strict_status("strict", ops, {"rollout": {"attention": e}, "trainer": {"attention": e}}) == {"strict_ok": True, "strict_violations": []}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_vime_parity_refuses_fa3_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "vime.cli", "parity", "--model", "/nonexistent", "--attention", "fa3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0 and "--attention fa3 needs a CUDA GPU and --dtype bfloat16" in out.stderr
