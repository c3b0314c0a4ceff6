"""SwiGLU's backward as one Triton launch (`backends/triton/swiglu_bwd.py`) under TRITON_INTERPRET=1: the bits of the
contract's composition (`reference.swiglu.backward`), torch.equal, in float32 and float16, for contiguous
operands and for gate/up as the column halves of fc1's output (strided rows), and through `rk`'s autograd node
(`reference.swiglu.SwigluFn` with `bwd=`). This interpreter has no libdevice: the kernel's exp is numpy's there, so
the composition here uses numpy's exp too — what is compared is the order and rounding of the arithmetic; the GPU
compares the kernel's libdevice exp with torch.exp (`scripts/gpu_strict_parity.py --only reduce`).
bfloat16: this interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even), so bf16 is recorded here,
not asserted; the GPU check compares it.
Negative control: the same arithmetic with one fused multiply-add (1 + g (1 - s) rounded once) differs.
"""
from __future__ import annotations

import importlib.util
import textwrap

import pytest

from helpers import run_interpreted

_SCRIPT = textwrap.dedent('''
    import numpy as np
    import torch
    from rlkernel.backends.reference import swiglu as R
    from rlkernel.backends.reference.primitives import Prims, REFERENCE
    from rlkernel.backends.triton import swiglu_bwd as K
    NP = Prims("numpy-exp", lambda x: torch.from_numpy(np.exp(x.float().numpy())), REFERENCE.log, REFERENCE.matmul)
    torch.manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.float16):
        for shape in ((7, 5), (3, 1000), (1, 1), (2, 3, 17)):
            gate, up, dy = ((torch.randn(*shape) * 4).to(dtype) for _ in range(3))
            got, want = K.backward(gate, up, dy), R.backward(gate, up, dy, NP)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (dtype, shape)
            n += 1
        inter = (torch.randn(9, 64) * 4).to(dtype)
        gate, up = inter.chunk(2, dim=-1)  # strided rows, as fc1's [gate; up] halves
        dy = torch.randn(9, 32).to(dtype)
        got, want = K.backward(gate, up, dy), R.backward(gate, up, dy, NP)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[0].is_contiguous()
        n += 1
    gate, up = torch.randn(6, 40, requires_grad=True), torch.randn(6, 40, requires_grad=True)
    g = torch.randn(6, 40)
    y1 = R.swiglu(gate, up, prims=NP)
    d1 = torch.autograd.grad(y1, (gate, up), g)
    y2 = R.swiglu(gate, up, prims=NP, bwd=K.backward)
    d2 = torch.autograd.grad(y2, (gate, up), g)
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(d1, d2))
    n += 1
    gf, uf, d = (torch.randn(4096) * 4 for _ in range(3))
    s = 1.0 / (torch.from_numpy(np.exp((-gf).numpy())) + 1.0)
    fused = (d * uf) * (s * (gf.double() * (1.0 - s).double() + 1.0).float())
    control = int((fused != R.backward(gf, uf, d, NP)[0]).sum())
    assert control > 0
    gb, ub, db = ((torch.randn(50) * 4).bfloat16() for _ in range(3))
    rec = sum(int((a != b).sum()) for a, b in zip(K.backward(gb, ub, db), R.backward(gb, ub, db, NP)))
    print("swiglu backward checks", n, "fma control differs in", control, "of 4096; bf16 record:", rec, "of 100")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_swiglu_backward_kernel_is_the_composition_under_interpreter():
    assert "swiglu backward checks 11" in run_interpreted(_SCRIPT)


_FWD_SCRIPT = textwrap.dedent('''
    import torch
    from rlkernel.backends.triton import gemm
    torch.manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.float16):
        for rows, cols in ((9, 32), (3, 1500), (1, 1)):
            inter = (torch.randn(rows, 2 * cols) * 4).to(dtype)
            gate, up = inter.chunk(2, dim=-1)  # the fused gate_up GEMM's halves: strided rows, no copy
            assert rows == 1 or not gate.is_contiguous()  # one row counts as contiguous: the flat kernel
            got, want = gemm.swiglu(gate, up), gemm.swiglu(gate.contiguous(), up.contiguous())
            assert got.is_contiguous() and got.shape == (rows, cols) and torch.equal(got, want), (dtype, rows, cols)
            n += 1
        g3 = (torch.randn(2, 3, 34) * 4).to(dtype)[..., :17]  # other layouts: copied first, as before
        assert torch.equal(gemm.swiglu(g3, g3), gemm.swiglu(g3.contiguous(), g3.contiguous()))
        n += 1
    print("swiglu forward strided checks", n)
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_swiglu_forward_takes_strided_rows_under_interpreter():
    """The fused gate_up GEMM's column halves go to the forward kernel without copies: the same bits as contiguous
    operands (fp32, fp16; 1,500 columns cross a block)."""
    assert "swiglu forward strided checks 8" in run_interpreted(_FWD_SCRIPT)
