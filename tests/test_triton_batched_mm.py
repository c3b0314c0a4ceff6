"""The Triton backend's float32 matmul primitive (`TRITON.matmul`, the Prims.matmul that strict
compositions call) on batched operands, under TRITON_INTERPRET=1: context parallelism's attention
backward multiplies [B*H, n, d] per head, and on an H200 (session 8, device call 7) the 2-D-only
primitive raised there. Batched == one GEMM per item, bit for bit (torch.equal), with broadcasting
batch dims and a transposed operand; and it is the product (correctness against torch.matmul). The
interpreter is numpy: the GPU's run is scripts/gpu_tp_parity.py --only cp on two H200s.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import interpreter_env

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import torch
    from rlkernel.backends.triton.ops import TRITON
    torch.manual_seed(0)
    a, b = torch.randn(3, 2, 17, 24), torch.randn(2, 24, 9)
    bt = torch.randn(2, 9, 24).transpose(1, 2)  # a transposed view: the weight path per item
    for rhs in (b, bt):
        out = TRITON.matmul(a, rhs)
        assert out.shape == (3, 2, 17, 9) and out.dtype == torch.float32
        per_item = torch.stack([torch.stack([TRITON.matmul(a[i, j].contiguous(), rhs[j]) for j in range(2)]) for i in range(3)])
        assert torch.equal(out, per_item)
        assert torch.allclose(out, a @ rhs, atol=1e-5, rtol=1e-5)  # correctness against torch, not a bit claim
    print("ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_batched_matmul_is_one_gemm_per_item():
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
