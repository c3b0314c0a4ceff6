"""The GEMM's SwiGLU epilogue (`gemm.matmul_swiglu`, the Triton fusion behind `rk.linear_swiglu`) under
TRITON_INTERPRET=1: bit for bit `matmul(x, [Wg; Wu])` split into halves and passed to `swiglu` (torch.equal), in
float32 and float16, at row counts and widths that are not tile multiples, a row alone equal to the same row inside
a batch, and tiles of several shapes (a scheduling choice). The interpreter's tl.dot is numpy's: what is compared is
the kernel's K walk, its masking and the epilogue's rounding and arithmetic; the H200 compares the wgmma chain in bf16
(`scripts/gpu_gemm_sweep.py --swiglu`). Negative control: the epilogue's arithmetic on the fp32 accumulators without
the rounding to the activation dtype differs in float16.

And the dispatcher's side on the CPU (`rk.linear_swiglu`): the composition's bits under strict and native, a registered
fusion used only where no gradient is wanted and no tap observes, provenance recording both ops, bad weights refused.
"""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import rlkernel as rk
from rlkernel import dispatch
from helpers import cpu_fusion, run_interpreted

_SCRIPT = textwrap.dedent('''
    import torch
    from rlkernel.backends.triton import gemm
    from rlkernel.contracts import gpu as G
    gemm._num_sms = lambda d: 3  # a persistent grid smaller than the tile count: programs walk several tiles
    torch.manual_seed(0)
    cfgs = [G.TileConfig(16, 16, 16, 2, 4, tma=False), G.TileConfig(32, 16, 32, 2, 4, tma=False),
            G.TileConfig(16, 32, 16, 2, 4, group_m=2, tma=False)]
    n = 0
    for dtype in (torch.float32, torch.float16):
        for m, inter, k in ((21, 40, 48), (1, 17, 16), (5, 32, 70), (33, 9, 40)):
            w = (torch.randn(2 * inter, k) * 0.3).to(dtype)
            x = torch.randn(m, k).to(dtype)
            for cfg in cfgs:
                gate, up = gemm.matmul(x, w, config=cfg).chunk(2, dim=-1)
                want = gemm.swiglu(gate, up)
                got = gemm.matmul_swiglu(x, w, config=cfg)
                assert got.shape == (m, inter) and got.dtype == dtype and torch.equal(got, want), (dtype, m, inter, k, cfg)
                row = m // 2
                assert torch.equal(gemm.matmul_swiglu(x[row:row + 1].contiguous(), w, config=cfg)[0], got[row])
                n += 1
            # tiles with one block_k give one K walk here (numpy sums a block_k slice at once: another block_k
            # is another order in the interpreter, not on sm_90's k16 wgmma chain)
            assert torch.equal(gemm.matmul_swiglu(x, w, config=cfgs[0]), gemm.matmul_swiglu(x, w, config=cfgs[2]))
    x, w = torch.randn(0, 16), torch.randn(8, 16)
    assert gemm.matmul_swiglu(x, w).shape == (0, 4)
    for bad in (torch.randn(7, 16), torch.randn(8, 15), torch.randn(8, 16).double()):
        try:
            gemm.matmul_swiglu(torch.randn(3, 16), bad)
            raise SystemExit(f"accepted a weight {tuple(bad.shape)} {bad.dtype}")
        except ValueError:
            pass
    # negative control: the epilogue's arithmetic without rounding gate and up to float16 first
    x, w = torch.randn(64, 64).half(), (torch.randn(2 * 64, 64) * 0.3).half()
    cfg = cfgs[0]
    acc = gemm.matmul(x, w, config=cfg, out_dtype=torch.float32)
    unrounded = gemm.swiglu(*acc.chunk(2, dim=-1)).half()
    control = int((unrounded != gemm.matmul_swiglu(x, w, config=cfg)).sum())
    assert control > 0
    print("matmul_swiglu checks", n, "unrounded control differs in", control, "of 4096")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemm_swiglu_epilogue_is_linear_then_swiglu_under_interpreter():
    assert "matmul_swiglu checks 24" in run_interpreted(_SCRIPT)


_OPS_SCRIPT = textwrap.dedent('''
    import warnings
    import torch
    from rlkernel.backends.triton import gemm, ops as O
    gemm._num_sms = lambda d: 3
    torch.manual_seed(0)
    x = torch.randn(5, 24)
    def composition(w):
        return gemm.swiglu(*gemm.matmul(x, w).chunk(2, dim=-1))
    w = torch.randn(40, 24) * 0.3
    assert O.linear_swiglu(x[:0], w).shape == (0, 20) and not O.FUSION_CHECKS  # no rows: nothing checked yet
    assert torch.equal(O.linear_swiglu(x, w), composition(w))  # the first call: both ways, bits compared
    assert O.FUSION_CHECKS[("linear_swiglu", "torch.float32", 40, 24)] is True
    assert torch.equal(O.linear_swiglu(x.reshape(1, 5, 24), w)[0], composition(w))  # then the one launch
    real = gemm.matmul_swiglu
    faults = {"differs": lambda a, b: real(a, b) * 1.0001, "raises": lambda a, b: 1 / 0}
    for i, (what, fault) in enumerate(faults.items()):  # fault injection: a launch that differs, one that fails
        gemm.matmul_swiglu = fault
        w2 = torch.randn(2 * (8 + i), 24) * 0.3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = O.linear_swiglu(x, w2)
        why = O.FUSION_CHECKS[("linear_swiglu", "torch.float32", 16 + 2 * i, 24)]
        assert isinstance(why, str) and ("differs" in why if what == "differs" else "ZeroDivisionError" in why), why
        ours = [str(c.message) for c in caught if "rlkernel" in str(c.message)]  # not the interpreter's numpy warnings
        assert len(ours) == 1 and "refused" in ours[0], [str(c.message) for c in caught]
        assert torch.equal(got, composition(w2)) and torch.equal(O.linear_swiglu(x, w2), composition(w2))
    gemm.matmul_swiglu = real
    print("fusion self-check ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_fusion_is_checked_at_first_use_and_refused_if_it_differs():
    """`backends.triton.ops.linear_swiglu` (the registered fusion) under the interpreter: its first call per weight shape
    compares the one launch with linear then swiglu; one that differs or raises is refused with a warning and the two
    launches serve that call and every later one."""
    assert "fusion self-check ok" in run_interpreted(_OPS_SCRIPT)


def _weights(dtype, m=7, inter=24, k=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g).to(dtype), (torch.randn(2 * inter, k, generator=g) * 0.2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["strict", "native"])
def test_linear_swiglu_is_the_composition(dtype, mode):
    x, w = _weights(dtype)
    with rk.mode(mode, impl="reference"):  # want by the other implementation (as test_rms_norm_rope_is_the_composition)
        gate, up = rk.linear(x, w).chunk(2, dim=-1)
        want = rk.swiglu(gate, up)
    with rk.mode(mode, impl="auto"):
        assert dispatch.call_fusion(("linear", "swiglu"), None, ((x, w), (x,)), x, w) is None
        got = rk.linear_swiglu(x, w)
        got3 = rk.linear_swiglu(x.reshape(1, 7, 40), w)
    assert torch.equal(got, want) and got.shape == (7, 24) and torch.equal(got3[0], want)


def test_linear_swiglu_refuses_a_weight_that_is_not_gate_and_up():
    x = torch.randn(3, 16)
    for bad in (torch.randn(7, 16), torch.randn(8, 15), torch.randn(8)):
        with pytest.raises(ValueError, match="gate/up weight"):
            rk.linear_swiglu(x, bad)


def test_a_registered_fusion_runs_only_without_grad_or_tap():
    """The dispatcher's routing, with a fusion registered for the CPU implementations for this test (the real one is
    the Triton backend's, CUDA only): it computes the composition itself and counts its calls."""
    calls = []

    def fused(x, w):
        calls.append(x.shape)
        g, u = rk.linear(x, w).chunk(2, dim=-1)
        return rk.swiglu(g, u)

    x, w = _weights(torch.float32)
    impls = (dispatch.resolve("linear", x.device), dispatch.resolve("swiglu", x.device))
    assert dispatch.fusion(("linear", "swiglu"), impls) is None  # nothing registered for the CPU
    want = rk.linear_swiglu(x, w)
    with cpu_fusion(("linear", "swiglu"), fused):
        counter = rk.ProvenanceCounter()
        with counter.collect():
            got = rk.linear_swiglu(x, w)
        assert calls == [x.shape] and torch.equal(got, want)
        ops = counter.take()
        assert ops["linear"][0]["calls"] >= 1 and ops["swiglu"][0]["calls"] >= 1  # both recorded
        seen = []
        with dispatch.tap(lambda op, impl, tensors, out: seen.append(op)):
            assert torch.equal(rk.linear_swiglu(x, w), want)
        assert calls == [x.shape] and seen == ["linear", "swiglu"]  # the tap saw each op; the fusion did not run
        xg = x.clone().requires_grad_()
        y = rk.linear_swiglu(xg, w)
        y.sum().backward()
        assert calls == [x.shape] and xg.grad is not None and torch.equal(y.detach(), want)
        with torch.no_grad():
            rk.linear_swiglu(xg, w)
        assert len(calls) == 2
    with pytest.raises(ValueError, match="register_fusion"):
        dispatch.register_fusion(("linear", "nope"), ("cpu", "cpu"), fused)
