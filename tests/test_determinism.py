"""Claim 3 (run-to-run determinism): the strict ops' forward values and backward
gradients are bitwise identical on every run and on 1 vs 2 threads, through a small
transformer-like block (rms_norm -> linear -> rope -> attention -> linear -> swiglu ->
linear -> linear_logprob) on a packed batch."""
import pytest
import torch

import rlkernel as rk
from helpers import threads

pytestmark = pytest.mark.usefixtures("impl")  # each test: CPU kernels and torch composition


T, HID, HQ, HKV, D, FF, V = 120, 96, 4, 2, 32, 200, 700  # odd sizes; the composition walks every K


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {
        "norm": torch.rand(HID, generator=g) + 0.5,
        "wqkv": torch.randn((HQ + 2 * HKV) * D, HID, generator=g) * HID**-0.5,
        "wo": torch.randn(HID, HQ * D, generator=g) * (HQ * D) ** -0.5,
        "wgu": torch.randn(2 * FF, HID, generator=g) * HID**-0.5,
        "wd": torch.randn(HID, FF, generator=g) * FF**-0.5,
        "lm": torch.randn(V, HID, generator=g) * HID**-0.5,
    }
    x = torch.randn(T, HID, generator=g)
    tgt = torch.randint(0, V, (T,), generator=g)
    return p, x, tgt


def _block(p, x, tgt, cu, pos):
    h = rk.rms_norm(x, p["norm"], 1e-6)
    qkv = rk.linear(h, p["wqkv"])
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q = rk.rope(q.reshape(T, HQ, D), pos, 1e4)
    k = rk.rope(k.reshape(T, HKV, D), pos, 1e4)
    a = rk.attention_varlen(q, k, v.reshape(T, HKV, D), cu)
    x = x + rk.linear(a.reshape(T, HQ * D), p["wo"])
    gate, up = rk.linear(rk.rms_norm(x, p["norm"], 1e-6), p["wgu"]).chunk(2, dim=-1)
    x = x + rk.linear(rk.swiglu(gate, up), p["wd"])
    return rk.linear_logprob(x, p["lm"], tgt, 0.9)


def _run(dtype):
    p, x, tgt = _params()
    p = {k: v.to(dtype).requires_grad_(True) for k, v in p.items()}
    x = x.to(dtype).requires_grad_(True)
    lens = [50, 17, 53]
    cu = torch.tensor([0, 50, 67, 120])
    pos = torch.cat([torch.arange(n) for n in lens])
    lp = _block(p, x, tgt, cu, pos)
    (lp * torch.linspace(-1, 1, T)).sum().backward()
    return [lp.detach()] + [x.grad] + [v.grad for v in p.values()]


def _equal(a, b):
    return all(torch.equal(u, w) for u, w in zip(a, b))


def test_forward_and_backward_are_run_to_run_deterministic():
    for dtype in (torch.float32, torch.bfloat16):
        assert _equal(_run(dtype), _run(dtype))


def test_forward_and_backward_do_not_depend_on_thread_count():
    for dtype in (torch.float32, torch.bfloat16):
        with threads(1):
            one = _run(dtype)
        with threads(2):
            two = _run(dtype)
        bad = [i for i, (u, w) in enumerate(zip(one, two)) if not torch.equal(u, w)]
        assert bad == [], f"{dtype}: outputs {bad} differ between 1 and 2 threads"
