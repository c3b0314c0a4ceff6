"""Qwen3's head norm and RoPE as one launch (`backends/triton/norm.py: norm_rope`, the Triton fusion behind
`rk.rms_norm_rope`) under TRITON_INTERPRET=1: bit for bit the norm kernel followed by the rope kernel (torch.equal), in
float32 and float16, for contiguous [T, heads, D] and for q/k as strided views of a fused qkv output (no copy), head
dims 16 / 64 / 128, positions in any order. The interpreter's tl.sum is numpy's in both kernels: what is compared is the
row's layout, the partner column's recomputation and the rounding points; the H200 compares the compiled kernels at
first use (`FUSION_CHECKS`, `scripts/gpu_reduce_checks.py`). Negative control: rotating the norm's unrounded float32
output (the rounding to the weight dtype skipped) differs in float16.

And the dispatcher's side on the CPU (`rk.rms_norm_rope`): the composition's bits under strict and native, bad input
refused, the decoder's engine layout calling the fusions (a counting fusion registered for the CPU implementations)."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import textwrap

import pytest
import torch

import rlkernel as rk
from rlkernel import dispatch
from helpers import cpu_fusion, run_interpreted

_SCRIPT = textwrap.dedent('''
    import warnings
    import torch
    from rlkernel.backends.reference import rope as R
    from rlkernel.backends.triton import norm, rope, ops as O
    torch.manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.float16):
        for t, hq, hkv, d in ((5, 4, 2, 16), (3, 2, 1, 64), (2, 3, 1, 128)):
            cos, sin = R.rope_table(d, 64, 1e6, "cpu")
            pos = torch.randperm(64)[:t]
            qkv = (torch.randn(t, (hq + 2 * hkv) * d) * 3).to(dtype)
            q = qkv[:, :hq * d].reshape(t, hq, d)  # strided views, as the engine's fused qkv output gives them
            k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
            for x in (q, k, q.contiguous()):
                w = (1.0 + 0.1 * torch.randn(d)).to(dtype)
                want = rope.forward(norm.rms_norm(x, w, 1e-6), pos, cos, sin)
                got = norm.norm_rope(x, w, 1e-6, pos, cos, sin)
                assert got.shape == want.shape and got.dtype == w.dtype and torch.equal(got, want), (dtype, t, d)
                n += 1
    # negative control: the rotation of the norm's float32 output, not rounded to float16 first
    x, w = (torch.randn(8, 4, 64) * 3).half(), (1.0 + 0.1 * torch.randn(64)).half()
    cos, sin = R.rope_table(64, 16, 1e6, "cpu")
    pos = torch.arange(8)
    xf = x.float()
    unrounded = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()
    control = int((R.forward(unrounded, pos, cos, sin).half() != norm.norm_rope(x, w, 1e-6, pos, cos, sin)).sum())
    assert control > 0
    # the registered fusion: checked at first use, then the one launch; a launch that differs is refused
    x = torch.randn(4, 2, 32)
    w = 1.0 + 0.1 * torch.randn(32)
    pos = torch.tensor([3, 0, 7, 1])
    cos, sin = R.rope_table(32, 8, 1e4, "cpu")
    want = rope.forward(norm.rms_norm(x, w, 1e-6), pos, cos, sin)
    assert torch.equal(O.rms_norm_rope(x, w, 1e-6, pos, 1e4, max_position=8), want)
    assert O.FUSION_CHECKS[("rms_norm_rope", "torch.float32", "torch.float32", 32, True, True)] is True
    assert torch.equal(O.rms_norm_rope(x, w, 1e-6, pos, 1e4, max_position=8), want)
    real = norm.norm_rope
    norm.norm_rope = lambda *a: real(*a) * 1.0001  # fault injection
    x3 = torch.randn(4, 3, 40)[:, :, :32]  # another key: row strides 120 and 40, not multiples of 16
    w3 = 1.0 + 0.1 * torch.randn(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = O.rms_norm_rope(x3, w3, 1e-6, pos, 1e4, max_position=8)
    norm.norm_rope = real
    assert len(caught) == 1 and "refused" in str(caught[0].message)
    assert torch.equal(got, rope.forward(norm.rms_norm(x3, w3, 1e-6), pos, cos, sin))
    print("norm_rope checks", n, "unrounded control differs in", control, "of 2048")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_norm_rope_kernel_is_the_norm_then_rope_under_interpreter():
    assert "norm_rope checks 18" in run_interpreted(_SCRIPT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["strict", "native"])
def test_rms_norm_rope_is_the_composition(dtype, mode):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 8 * 16, generator=g).to(dtype)
    q = qkv[:, :4 * 16].reshape(6, 4, 16)  # a strided view
    w = (1.0 + 0.1 * torch.randn(16, generator=g)).to(dtype)
    pos = torch.tensor([5, 0, 9, 2, 2, 31])
    # want by the other implementation (strict: the torch composition; the CPU kernels run `got`), so that the
    # check is not the function's own fallback against itself; on the CPU no fusion is registered
    with rk.mode(mode, impl="reference"):
        want = rk.rope(rk.rms_norm(q, w, 1e-6), pos, 1e6)
    with rk.mode(mode, impl="auto"):
        assert dispatch.call_fusion(("rms_norm", "rope"), None, ((q, w), (q, pos)), q, w, 1e-6, pos, 1e6, None) is None
        assert torch.equal(rk.rms_norm_rope(q, w, 1e-6, pos, 1e6), want)
        assert torch.equal(rk.rms_norm_rope(q, w, 1e-6, pos, 1e6, max_position=32), want)


def test_rms_norm_rope_refuses_bad_input():
    x, pos = torch.randn(3, 2, 8), torch.arange(3)
    with pytest.raises(ValueError, match="weight"):
        rk.rms_norm_rope(x, torch.ones(6), 1e-6, pos, 1e4)
    with pytest.raises(ValueError, match="positions"):
        rk.rms_norm_rope(x, torch.ones(8), 1e-6, torch.arange(4), 1e4)
    with pytest.raises(ValueError, match="even"):
        rk.rms_norm_rope(torch.randn(3, 2, 7), torch.ones(7), 1e-6, pos, 1e4)
    with pytest.raises(ValueError, match="max_position"):
        rk.rms_norm_rope(x, torch.ones(8), 1e-6, torch.tensor([0, 1, 9]), 1e4, max_position=8)


@contextlib.contextmanager
def _counting_fusions(calls: dict):
    """Fusions for the CPU implementations that count their calls and compute the composition (the real ones are
    the Triton backend's, CUDA only): which chains the decoder hands to the dispatcher as one op."""
    def linear_swiglu(x, w):
        calls["linear_swiglu"] = calls.get("linear_swiglu", 0) + 1
        return rk.swiglu(*rk.linear(x, w).chunk(2, dim=-1))

    def rms_norm_rope(x, w, eps, pos, theta, max_position):
        calls["rms_norm_rope"] = calls.get("rms_norm_rope", 0) + 1
        return rk.rope(rk.rms_norm(x, w, eps), pos, theta, max_position=max_position)

    with cpu_fusion(("linear", "swiglu"), linear_swiglu), cpu_fusion(("rms_norm", "rope"), rms_norm_rope):
        yield


def test_the_engine_layout_hands_both_chains_to_the_dispatcher(tmp_path):
    from rlkernel.models import StrictDecoder
    from vime.tiny_model import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "q", seed=3, init_std=0.08, arch="qwen3", vocab_size=131, hidden_size=48,
                                intermediate_size=80, num_heads=4, num_kv_heads=2, head_dim=12, num_layers=3)
    sep = StrictDecoder.from_pretrained(ckpt, dtype=torch.bfloat16)
    fused = copy.deepcopy(sep)
    fused.fuse_projections()
    ids = torch.randint(4, 131, (21,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 9, 21])
    with torch.no_grad():
        want = sep.forward_packed(ids, cu)
        calls = {}
        with _counting_fusions(calls):
            assert torch.equal(sep.forward_packed(ids, cu), want) and calls == {}  # the plain layout asks for none
            got = fused.forward_packed(ids, cu)
            assert calls == {"linear_swiglu": 3, "rms_norm_rope": 6}, calls  # per layer: gate/up + swiglu; q and k
            hook = fused.model.layers[1].self_attn.q_norm.register_forward_hook(lambda *a: None)
            try:  # a hook on a head norm (vime diagnose) keeps that layer's norms and rotations apart
                assert torch.equal(fused.forward_packed(ids, cu), want)
            finally:
                hook.remove()
            assert calls == {"linear_swiglu": 6, "rms_norm_rope": 10}, calls
    assert torch.equal(got, want)
