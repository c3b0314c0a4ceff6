"""Claim 6 (correctness): each strict op computes the same function as the native op and a
float64 reference, within dtype-appropriate tolerance, and its gradients agree with
autograd through the native ops."""
import pytest
import torch
import torch.nn.functional as F

import rlkernel as rk

pytestmark = pytest.mark.usefixtures("impl")  # each test: CPU kernels and torch composition

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_float64(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g)
    w = torch.randn(90, 200, generator=g)
    b = torch.randn(90, generator=g)
    assert _rel(rk.linear(x.to(dtype), w.to(dtype), b.to(dtype)), F.linear(x.double(), w.double(), b.double())) < TOL[dtype]
    nw = torch.rand(200, generator=g) + 0.5
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    assert _rel(rk.rms_norm(x.to(dtype), nw.to(dtype), 1e-6), ref) < TOL[dtype]
    gate, up = torch.randn(37, 77, generator=g) * 3, torch.randn(37, 77, generator=g)
    assert _rel(rk.swiglu(gate.to(dtype), up.to(dtype)), F.silu(gate.double()) * up.double()) < TOL[dtype]
    h, lm = torch.randn(37, 64, generator=g), torch.randn(1100, 64, generator=g)
    t = torch.randint(0, 1000, (37,), generator=g)
    ref_lp = torch.log_softmax((h.double() @ lm[:1000].double().t()) / 0.7, -1).gather(1, t[:, None])[:, 0]
    lp = rk.linear_logprob(h.to(dtype), lm.to(dtype), t, 0.7, vocab_size=1000)
    assert lp.dtype == torch.float32
    if dtype == torch.float32:
        assert (lp.double() - ref_lp).abs().max() < 1e-4
    xr, pos = torch.randn(37, 3, 32, generator=g), torch.randint(0, 5000, (37,), generator=g)
    inv = 1.0 / (1e6 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    ang = pos.double()[:, None, None] * inv
    x1, x2 = xr.double()[..., :16], xr.double()[..., 16:]
    ref_rope = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    assert _rel(rk.rope(xr.to(dtype), pos, 1e6), ref_rope) < TOL[dtype]


def test_rope_table_does_not_depend_on_its_length():
    small = rk.rope_table(64, 100, 12345.0)[0][:100].clone()
    big = rk.rope_table(64, 5000, 12345.0)[0]
    assert torch.equal(small, big[:100])


def test_rope_table_growth_keeps_the_replaced_table_alive():
    """A CUDA graph captured with a table holds its address, not a reference: when a longer stream grows the table, the
    old one must stay allocated with its rows (session 17: an in-process scorer grew the engine's table and the engine's
    graph replays rotated by freed memory). Growth at least doubles, so the kept tables stay small."""
    import gc
    import weakref

    theta = 23456.0  # a table no other test makes
    old_cos, old_sin = rk.rope_table(32, 300, theta)
    rows = old_cos.shape[0]
    kept_c, kept_s = old_cos.clone(), old_sin.clone()
    refs = weakref.ref(old_cos), weakref.ref(old_sin)
    del old_cos, old_sin
    new_cos, new_sin = rk.rope_table(32, rows + 1, theta)
    gc.collect()
    assert refs[0]() is not None and refs[1]() is not None, "the replaced table was freed"
    assert torch.equal(refs[0](), kept_c) and torch.equal(refs[1](), kept_s)
    assert torch.equal(new_cos[:rows], kept_c) and torch.equal(new_sin[:rows], kept_s)
    assert new_cos.shape[0] >= 2 * rows


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("case", ["linear", "rms_norm", "swiglu", "rope", "attention", "linear_logprob", "linear_entropy"])
def test_gradients_match_native_autograd(case):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if case == "linear":
        args, fn = (r(33, 70), r(50, 70), r(50)), lambda mode: (lambda x, w, b: rk.linear(x, w, b, backend=mode))
    elif case == "rms_norm":
        args, fn = (r(33, 70) * 2, r(70).abs() + 0.5), lambda mode: (lambda x, w: rk.rms_norm(x, w, 1e-6, backend=mode))
    elif case == "swiglu":
        args, fn = (r(33, 70) * 3, r(33, 70)), lambda mode: (lambda a, b: rk.swiglu(a, b, backend=mode))
    elif case == "rope":
        pos = torch.arange(33)
        args, fn = (r(33, 2, 16),), lambda mode: (lambda x: rk.rope(x, pos, 1e4, backend=mode))
    elif case == "attention":
        cu = torch.tensor([0, 40, 45, 80])
        args, fn = (r(80, 4, 16), r(80, 2, 16), r(80, 2, 16)), lambda mode: (lambda q, k, v: rk.attention_varlen(q, k, v, cu, backend=mode))
    elif case == "linear_entropy":
        args, fn = (r(33, 24), r(1100, 24) * 0.5), lambda mode: (lambda h, w: rk.linear_entropy(h, w, 0.8, vocab_size=1050, backend=mode))
    else:
        t = torch.randint(0, 600, (33,), generator=g)
        args, fn = (r(33, 24), r(640, 24)), lambda mode: (lambda h, w: rk.linear_logprob(h, w, t, 0.8, vocab_size=600, backend=mode))
    out_s, g_s = _grads(fn("strict"), *args)
    out_n, g_n = _grads(fn("native"), *args)
    assert _rel(out_s, out_n) < 1e-5
    for a, b in zip(g_s, g_n):
        assert _rel(a, b) < 1e-4, case
