"""A quick, readable demonstration of the strict contract on this machine.

For each rlkernel op a fixed row is computed alone and inside batches of
1..rows rows; the count of differing rows is reported for the strict path and
the native path side by side, plus prefill vs decode for attention. Strict must
be 0; native shows what the strict path protects against.
"""
from __future__ import annotations

import platform

import torch
from tqdm import tqdm

import rlkernel as rk


def _row_mismatch(fn, make, rows):
    g = torch.Generator().manual_seed(0)
    base = make(1, g)
    ref = fn(*base)[0]
    bad = 0
    for m in sorted({1, 2, 3, 7, 16, rows}):
        args = [t.clone() for t in make(m, g)]
        for a, b in zip(args, base):
            a[m - 1] = b[0]
        bad += not torch.equal(fn(*args)[m - 1], ref)
    return bad


def _attention_prefill_vs_decode(backend):
    g = torch.Generator().manual_seed(0)
    L, hq, hkv, d = 45, 4, 2, 16
    q, k, v = (torch.randn(L, h, d, generator=g) for h in (hq, hkv, hkv))
    full = rk.attention_varlen(q, k, v, torch.tensor([0, L]), backend=backend)
    kc, vc = k.reshape(-1, 1, hkv, d).clone(), v.reshape(-1, 1, hkv, d).clone()  # block size 1, identity table
    table = torch.arange(L, dtype=torch.int32)[None]
    bad = 0
    for t in range(L):
        out = rk.attention_paged(q[t:t + 1], kc, vc, table, torch.tensor([t + 1]), torch.tensor([0, 1]), backend=backend)
        bad += not torch.equal(out[0], full[t])
    return bad


def run_selfcheck(rows: int = 64) -> dict:
    K, N, V = 1000, 300, 1900
    g = torch.Generator().manual_seed(1)
    w, nw, lm = torch.randn(N, K, generator=g), torch.rand(K, generator=g) + 0.5, torch.randn(V, 64, generator=g)
    cases = {
        "linear": (lambda be: lambda x: rk.linear(x, w, backend=be), lambda m, g: (torch.randn(m, K, generator=g),)),
        "rms_norm": (lambda be: lambda x: rk.rms_norm(x, nw, 1e-6, backend=be), lambda m, g: (torch.randn(m, K, generator=g),)),
        "swiglu": (lambda be: lambda a, b: rk.swiglu(a, b, backend=be), lambda m, g: (torch.randn(m, 5, generator=g) * 4, torch.randn(m, 5, generator=g))),
        "linear_logprob": (lambda be: lambda h, t: rk.linear_logprob(h, lm, t, 0.7, backend=be),
                           lambda m, g: (torch.randn(m, 64, generator=g), torch.randint(0, V, (m,), generator=g))),
    }
    report = {"machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(), "ops": {}}
    strict_total = 0
    for op, (fn, make) in tqdm(cases.items(), desc="rlkernel selfcheck", unit="op"):
        s, n = _row_mismatch(fn("strict"), make, rows), _row_mismatch(fn("native"), make, rows)
        report["ops"][op] = {"strict_mismatch": s, "native_mismatch": n}
        strict_total += s
    s, n = _attention_prefill_vs_decode("strict"), _attention_prefill_vs_decode("native")
    report["ops"]["attention(prefill vs decode)"] = {"strict_mismatch": s, "native_mismatch": n}
    report["strict_mismatches"] = strict_total + s
    return report
