"""RoPE's Triton kernel (`backends/triton/rope.py`, one launch a call) under TRITON_INTERPRET=1: the bits of the
reference composition (`reference.rope.forward`) with torch.equal, in float32 and float16, for several shapes,
a strided head view (q out of a fused projection) and the negated sine table (the backward's inverse rotation);
and through `reference.rope.rope` with autograd, the same output and gradient bits as the composition's.
bfloat16 is not compared here: this interpreter truncates float32 -> bfloat16 where the GPU (and torch) round
to nearest even — recorded below, not asserted; `scripts/gpu_strict_parity.py` compares bf16 on the H200.
Negative control: the same rotation with a fused multiply-add (one rounding instead of two) differs from the
composition on some elements, so the equalities are not equal by accident of the data.
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
    from rlkernel.backends.reference import rope as R
    from rlkernel.backends.triton import rope as T
    torch.manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.float16):
        for (t, h, d) in ((7, 3, 16), (33, 16, 128), (1, 1, 2), (5, 8, 12)):
            cos, sin = R.rope_table(d, 4096, 1e6 if d > 16 else 10000.0, "cpu")
            pos = torch.randint(0, 4000, (t,))
            x = (torch.randn(t, h, d) * 3).to(dtype)
            assert torch.equal(R.forward(x, pos, cos, sin), T.forward(x, pos, cos, sin)), (dtype, t, h, d)
            xv = torch.randn(t, 2 * h, d).to(dtype)[:, ::2]  # head stride 2d: a view
            assert torch.equal(R.forward(xv, pos, cos, sin), T.forward(xv, pos, cos, sin))
            g = torch.randn(t, h, d).to(dtype)
            assert torch.equal(R.forward(g, pos, cos, -sin), T.forward(g, pos, cos, -sin))
            n += 3
    x = torch.randn(9, 4, 32, requires_grad=True)
    pos = torch.arange(9) * 7
    y1 = R.rope(x, pos, 10000.0)
    g = torch.randn_like(y1)
    (d1,) = torch.autograd.grad(y1, x, g)
    y2 = R.rope(x, pos, 10000.0, fwd=T.forward)
    (d2,) = torch.autograd.grad(y2, x, g)
    assert torch.equal(y1, y2) and torch.equal(d1, d2)
    cos, sin = R.rope_table(128, 4096, 1e6, "cpu")
    pos = torch.randint(0, 4000, (256,))
    x = torch.randn(256, 8, 128)
    x1, x2 = x[..., :64].double(), x[..., 64:].double()
    c, s = cos[pos].unsqueeze(-2).double(), sin[pos].unsqueeze(-2).double()
    fused = torch.cat([(x1 * c - (x2.float() * s.float()).double()).float(), (x2 * c + (x1.float() * s.float()).double()).float()], -1)
    control = int((fused != R.forward(x, pos, cos, sin)).sum())
    assert control > 0
    xb = (torch.randn(7, 3, 16) * 3).to(torch.bfloat16)
    cos, sin = R.rope_table(16, 64, 10000.0, "cpu")
    pos = torch.arange(7)
    print("record: bf16 elements where this interpreter differs from torch:",
          int((R.forward(xb, pos, cos, sin) != T.forward(xb, pos, cos, sin)).sum()), "of", xb.numel())
    print("fma control differs on", control, "checked", n + 1, "ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_rope_kernel_matches_the_composition_bit_for_bit():
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    print(proc.stdout)
