"""rlkernel.tree_sum's Triton kernel (`backends/triton/reduce.py`) under TRITON_INTERPRET=1: the same
bits as the torch composition for every length (padding, several launches, one row), column count
and reduced dim, -0.0 included; every (C, R) that `_shape` gives, launched alone, against the tree
of each padded block (the strided loads' tiles added pairwise, then the split); and through the
device hook (`register_tree_sum`) that CUDA uses, here registered for the CPU inside the subprocess.
The interpreter is numpy: this proves the fold order and the masks; the GPU's bits are compared by
scripts/gpu_strict_parity.py on an H200.
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
    from rlkernel.backends.reference import primitives as P
    from rlkernel.backends.triton import reduce as R

    def bits(t):
        return t.contiguous().view(torch.int32)

    g = torch.Generator().manual_seed(0)
    cases = 0
    for n in (1, 2, 3, 5, 64, 65, 127, 1000, 4096, 4097, 9000):
        for m in (1, 3, 64, 130):
            if n * m > 300_000:
                continue
            x = torch.randn(n, m, generator=g) * torch.exp(torch.randn(n, m, generator=g) * 8)
            x[torch.rand(n, m, generator=g) < 0.05] = -0.0
            got, want = R.tree_sum_rows(x), P.tree_sum_composition(x, dim=0)
            assert torch.equal(bits(got), bits(want)), (n, m, (got - want).abs().max())
            cases += 1
    # every (log2 R, C) that _shape gives (it reads only P and whether m == 1), one launch each on 2.5 blocks of rows
    # and C + 1 columns (a partial block and a masked column block): each block's sum is the contract's tree over its
    # R rows with +0.0 past n -- the K strided loads' tiles added pairwise, then the G block sums split in registers
    from rlkernel.backends.triton.launch import cdiv
    classes = sorted({R._shape(1 << b, m) for b in range(1, 20) for m in (1, 2)})
    assert len(classes) == 23, classes
    for log2r, c in classes:
        r = 1 << log2r
        n, m = 2 * r + r // 2 + 1, c + 1
        x = torch.randn(n, m, generator=g) * torch.exp(torch.randn(n, m, generator=g) * 8)
        x[torch.rand(n, m, generator=g) < 0.05] = -0.0
        blocks, col_blocks = cdiv(n, r), cdiv(m, c)
        y = torch.empty(blocks, m)
        R._tree_rows_kernel[(blocks * col_blocks,)](x, y, n, m, col_blocks, C=c, R=r, LOG2R=log2r,
                                                    num_warps=R.NUM_WARPS)
        padded = torch.zeros(blocks * r, m)
        padded[:n] = x
        want = P.tree_sum_composition(padded.view(blocks, r, m), dim=1)
        assert torch.equal(bits(y), bits(want)), (log2r, c, (y - want).abs().max())
        cases += 1
    # launches: a length up to 4,096 in one (the RMSNorm weight gradients' trees), longer ones by 64-row blocks first
    launched = []
    kernel = R._tree_rows_kernel_fast

    class Count:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    R._tree_rows_kernel_fast = Count()
    for n, m, want_launches in ((1000, 64, 1), (4096, 3, 1), (2048, 130, 1), (4097, 3, 2), (9000, 1, 2)):
        launched.clear()
        x = torch.randn(n, m, generator=g)
        assert torch.equal(bits(R.tree_sum_rows(x)), bits(P.tree_sum_composition(x, dim=0))), (n, m)
        assert len(launched) == want_launches, (n, m, launched)
    R._tree_rows_kernel_fast = kernel
    # -0.0 survives exactly where the composition keeps it (a single row, a whole tree of -0.0 rows gives +0.0)
    z = torch.full((1, 4), -0.0)
    assert torch.equal(bits(R.tree_sum_rows(z)), bits(P.tree_sum(z, dim=0)))
    z = torch.full((3, 4), -0.0)
    assert torch.equal(bits(R.tree_sum_rows(z)), bits(P.tree_sum(z, dim=0)))
    # the order is the tree's, not a running sum: (1e8 + 1) + (-1e8 + 1) rounds to 0, left to right gives 1
    v = torch.tensor([[1e8], [1.0], [-1e8], [1.0]])
    assert R.tree_sum_rows(v).item() == 0.0 and ((v[0] + v[1]) + v[2] + v[3]).item() == 1.0
    # through the device hook, any dim of a 3-D tensor (the CUDA registration's path, here on the CPU)
    x = torch.randn(6, 37, 5, generator=g)
    want = [P.tree_sum(x, dim=d) for d in range(3)]
    P.register_tree_sum("cpu", R.tree_sum_rows, lambda: True)
    try:
        for d in range(3):
            got = P.tree_sum(x, dim=d)
            assert got.shape == want[d].shape and torch.equal(bits(got), bits(want[d])), d
        y = x.clone().requires_grad_()
        assert P.tree_sum(y, dim=1).grad_fn is not None  # autograd keeps the composition
        # an empty sum is +0.0 through the hook too (a 211-token vocab's last canonical segment holds no rows: the GPU
        # grad norm of a toy model raised here on the H200, session 16)
        assert torch.equal(bits(P.tree_sum(torch.zeros(0), dim=0)), bits(torch.zeros(())))
        assert torch.equal(bits(P.tree_sum(torch.zeros(0, 3), dim=0)), bits(torch.zeros(3)))
        from rlkernel.parallel import tp_backward as TB
        vg = torch.randn(5, 4, generator=g)
        vals = TB._segment_values(vg, ("rows", 2, 4))  # rows 0:2, 2:4, 4:5 and an empty fourth segment
        assert [float(v) for v in vals[3:]] == [0.0] and torch.equal(vals[2], P.tree_sum(vg[4].square(), dim=0))
    finally:
        P._DEVICE_TREE.pop("cpu")
    print(cases, "ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tree_sum_kernel_matches_the_composition_bit_for_bit():
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert int(proc.stdout.split()[-2]) >= 30 + 23
