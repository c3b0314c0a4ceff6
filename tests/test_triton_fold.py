"""The vocab-parallel backward's tile fold in one Triton launch (`backends/triton/fold.py`) under TRITON_INTERPRET=1:
the bits of the per-tile composition ((acc + a_0 @ b_0) + a_1 @ b_1) + ... with each product the strict float32 GEMM
(`backends.triton.ops._mm32`), torch.equal, for several shapes (a short last tile, rows and columns that are not
whole blocks, a bf16 right-hand side, a strided left-hand side, both operands bf16); and through `parallel.vocab_parallel.local_backward`
(which takes the fold, and for a bf16 head the fused dz kernel, where the implementation's prims have them) against
the per-tile definition, every partial and dW bit for bit, and the fused dz against the composition it replaces (to a
tolerance: another exp). Negative control: one GEMM over the whole K range (no per-tile restart) differs from the fold.
On the H200: `scripts/gpu_strict_parity.py --only reduce` (`vocab_backward_chunks_equal_tiles`).
"""
from __future__ import annotations

import importlib.util
import textwrap

import pytest

from helpers import run_interpreted

_SCRIPT = textwrap.dedent('''
    import torch
    from rlkernel.backends.triton import fold as F
    from rlkernel.backends.triton.ops import TRITON, _mm32
    from rlkernel.parallel import vocab_parallel as vp
    torch.manual_seed(0)

    def composition(acc, a, b, tile):
        for t in range(0, a.shape[1], tile):
            acc = acc + _mm32(a[:, t:t + tile], b[t:t + tile])
        return acc

    n = 0
    for (m, k, nn, tile, dt, a_dt) in ((5, 100, 7, 32, torch.float32, torch.float32), (70, 256, 65, 64, torch.bfloat16, torch.float32),
                                       (1, 40, 3, 40, torch.float32, torch.float32), (33, 96, 129, 32, torch.bfloat16, torch.float32),
                                       # both operands bf16 (a bf16 model's rounded dz and lm_head): the GEMM kernel's K walk
                                       (70, 256, 65, 64, torch.bfloat16, torch.bfloat16), (9, 1100, 40, 512, torch.bfloat16, torch.bfloat16)):
        a = torch.randn(m, 2 * k).to(a_dt)[:, ::2]  # a strided view (gz's columns of a chunk)
        b = (torch.randn(k, nn) * 0.1).to(dt)
        acc = torch.randn(m, nn)
        got, want = F.fold_matmul(acc, a, b, tile), composition(acc, a, b, tile)
        assert torch.equal(got, want), (m, k, nn, tile, dt)
        n += 1
    a, b, acc = torch.randn(40, 192), torch.randn(192, 48), torch.zeros(40, 48)
    whole = _mm32(a, b)
    control = int((whole != F.fold_matmul(acc, a, b, 64)).sum())
    assert control > 0

    from rlkernel.contracts.logprob import VOCAB_TILE
    T, H, tiles = 9, 32, 5
    weight = (torch.randn(tiles * VOCAB_TILE - 100, H) * 0.05).bfloat16()  # a short last tile
    h32, lse, grad = torch.randn(T, H), torch.randn(T) + 5.0, torch.randn(T)
    start = 0
    targets = torch.randint(0, weight.shape[0], (T,))
    span = (0, weight.shape[0])
    for segments in (None, [(0, 2 * VOCAB_TILE), (2 * VOCAB_TILE, 4 * VOCAB_TILE), (4 * VOCAB_TILE, 6 * VOCAB_TILE)]):
        args = (h32, weight, targets, lse, grad, start, span, segments, 0.9, TRITON)
        (pa, gwa), (pb, gwb) = vp.local_backward(*args), vp.local_backward_per_tile(*args)
        assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb)) and torch.equal(gwa, gwb)
        assert TRITON.fold_matmul is not None
        n += 1
    # the fused dz kernel (a bf16 head on the Triton prims) against the composition it replaces (the tile's logits
    # GEMM, torch's exp, the target's +1, the cast): another exp (exp2 of a scaled argument), so a tolerance, not bits
    import dataclasses
    comp = dataclasses.replace(TRITON, grad_z=None)
    args = (h32, weight, targets, lse, grad, start, span, None, 0.9)
    (pf,), gwf = vp.local_backward(*args, TRITON)
    (pc,), gwc = vp.local_backward(*args, comp)
    assert torch.allclose(pf, pc, rtol=0, atol=1e-2 * float(pc.abs().max())) and pc.abs().sum() > 0
    assert torch.allclose(gwf, gwc, rtol=0, atol=1e-2 * float(gwc.abs().max())) and gwc.abs().sum() > 0
    n += 1
    print("fold checks", n, "control differs in", control, "of", whole.numel())
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fold_kernel_is_the_per_tile_composition_under_interpreter():
    assert "fold checks 9" in run_interpreted(_SCRIPT)
