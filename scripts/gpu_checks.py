#!/usr/bin/env python3
"""rlkernel's strict `reference` backend on a CUDA device: invariance checks with negative
controls, and strict/native timings, printed as one JSON object (last line).

Runs anywhere torch sees a GPU (no vLLM/Megatron needed); `tests/test_gpu_reference.py`
runs the same checks under pytest when CUDA is available and skips otherwise.
"""
from __future__ import annotations

import json
import time

import torch

import rlkernel as rk


def _rows_differ(fn, make, row, sizes=(1, 2, 3, 7, 16, 64, 65, 128, 257, 1024)):
    """How many (M, position) placements change the row's bits vs computing it alone."""
    ref = fn(*row)[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for m in sizes:
        for pos in {0, m // 2, m - 1}:
            args = [t.clone() for t in make(m, g)]
            for a, r in zip(args, row):
                a[pos] = r[0]
            bad += not torch.equal(fn(*args)[pos], ref)
    return bad


def batch_invariance(dtype=torch.bfloat16) -> dict:
    dev, K, N, V, H = "cuda", 4096, 1024, 3001, 256
    g = torch.Generator(device=dev).manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, device=dev).to(dtype)  # noqa: E731
    w, nw, lm = r(N, K) * K**-0.5, (torch.rand(K, device=dev) + 0.5).to(dtype), r(V, H)
    out = {}
    cases = {
        "linear": (lambda be: (lambda x: rk.linear(x, w, backend=be)), lambda m, g: (torch.randn(m, K, generator=g, device=dev).to(dtype),), (r(1, K),)),
        "rms_norm": (lambda be: (lambda x: rk.rms_norm(x, nw, 1e-6, backend=be)), lambda m, g: (torch.randn(m, K, generator=g, device=dev).to(dtype),), (r(1, K),)),
        "swiglu": (lambda be: (lambda a, b: rk.swiglu(a, b, backend=be)), lambda m, g: (torch.randn(m, 1001, generator=g, device=dev).to(dtype), torch.randn(m, 1001, generator=g, device=dev).to(dtype)), (r(1, 1001), r(1, 1001))),
        "linear_logprob": (lambda be: (lambda h, t: rk.linear_logprob(h, lm, t, 0.8, backend=be)), lambda m, g: (torch.randn(m, H, generator=g, device=dev).to(dtype), torch.randint(0, V, (m,), generator=g, device=dev)), (r(1, H), torch.tensor([V - 2], device=dev))),
    }
    for op, (fn, make, row) in cases.items():
        out[op] = {"strict_mismatch": _rows_differ(fn("reference"), make, row), "native_mismatch": _rows_differ(fn("native"), make, row)}
    return out


def prefill_vs_decode(dtype=torch.bfloat16) -> dict:
    dev, L, hq, hkv, d = "cuda", 300, 16, 8, 128
    g = torch.Generator(device=dev).manual_seed(2)
    q, k, v = (torch.randn(L, h, d, generator=g, device=dev).to(dtype) for h in (hq, hkv, hkv))
    res = {}
    for be in ("reference", "native"):
        full = rk.attention_varlen(q, k, v, torch.tensor([0, L], device=dev), backend=be)
        bs = 16
        kc, vc = torch.zeros(L // bs + 1, bs, hkv, d, device=dev, dtype=dtype), torch.zeros(L // bs + 1, bs, hkv, d, device=dev, dtype=dtype)
        perm = torch.randperm(L // bs + 1, device=dev)
        table = perm[None].int()
        pos = torch.arange(L, device=dev)
        slots = perm[pos // bs] * bs + pos % bs
        rk.write_kv_cache(k, v, kc, vc, slots)
        bad = 0
        for t in range(0, L, 7):
            o = rk.attention_paged(q[t:t + 1], kc, vc, table, torch.tensor([t + 1], device=dev), torch.tensor([0, 1], device=dev), backend=be)
            bad += not torch.equal(o[0], full[t])
        res[be] = bad
    return {"strict_mismatch": res["reference"], "native_mismatch": res["native"]}


def determinism() -> bool:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(333, 512, generator=g, device="cuda").requires_grad_(True)
    w = torch.randn(700, 512, generator=g, device="cuda").requires_grad_(True)
    t = torch.randint(0, 700, (333,), generator=g, device="cuda")

    def run():
        x.grad = w.grad = None
        lp = rk.linear_logprob(rk.rms_norm(x, torch.ones(512, device="cuda"), 1e-6), w, t, 0.9)
        lp.sum().backward()
        return lp.detach().clone(), x.grad.clone(), w.grad.clone()

    a, b = run(), run()
    return all(torch.equal(u, v) for u, v in zip(a, b))


def timings(dtype=torch.bfloat16) -> dict:
    dev = "cuda"
    T, H, hq, hkv, d, F, V = 2048, 1024, 16, 8, 128, 3072, 151936
    x, w = torch.randn(T, H, device=dev, dtype=dtype), torch.randn(3 * H, H, device=dev, dtype=dtype)
    gate, up = torch.randn(T, F, device=dev, dtype=dtype), torch.randn(T, F, device=dev, dtype=dtype)
    q, k, v = (torch.randn(T, h, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, T // 2, T], device=dev)
    lm, tg = torch.randn(V, H, device=dev, dtype=dtype), torch.randint(0, V, (256,), device=dev)
    cases = {
        "linear": lambda be: rk.linear(x, w, backend=be),
        "rms_norm": lambda be: rk.rms_norm(x, w[0], 1e-6, backend=be),
        "swiglu": lambda be: rk.swiglu(gate, up, backend=be),
        "attention_prefill": lambda be: rk.attention_varlen(q, k, v, cu, backend=be),
        "linear_logprob_256tok": lambda be: rk.linear_logprob(x[:256], lm, tg, 1.0, backend=be),
    }
    out = {}
    for name, fn in cases.items():
        ms = {}
        for be in ("reference", "native"):
            fn(be)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                fn(be)
            torch.cuda.synchronize()
            ms[be] = (time.perf_counter() - t0) / 3 * 1e3
        out[name] = {"strict_ms": round(ms["reference"], 3), "native_ms": round(ms["native"], 3), "ratio": round(ms["reference"] / ms["native"], 2)}
    return out


def main():
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    with torch.no_grad():
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "batch_invariance_bf16": batch_invariance(), "batch_invariance_fp32": batch_invariance(torch.float32),
                  "prefill_vs_decode_bf16": prefill_vs_decode()}
    report["determinism_fwd_bwd"] = determinism()
    with torch.no_grad():
        report["timings_bf16"] = timings()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
