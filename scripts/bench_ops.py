#!/usr/bin/env python3
"""Per-op CPU timings, strict (reference backend) vs native, side by side in one process.

Prints one line per (size, op, phase) with both medians and the ratio strict/native,
then a JSON summary (also written to --out). Sizes: `tiny` (the test model) and
`qwen3-0.6b` (hidden 1024, 16/8 heads of 128, ffn 3072, vocab 151936).
Figures are machine-specific; quote them with the machine and thread count.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import rlkernel as rk

SIZES = {
    "tiny": dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=128, vocab=512, tokens=128, decode=8),
    "qwen3-0.6b": dict(hidden=1024, heads=16, kv=8, head_dim=128, ffn=3072, vocab=151936, tokens=512, decode=8),
}


def _time(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cases(c, dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    T, H, D = c["tokens"], c["hidden"], c["head_dim"]
    x, w_qkv = r(T, H), r((c["heads"] + 2 * c["kv"]) * D, H) * H**-0.5
    nw = torch.ones(H, dtype=dtype)
    gate, up = r(T, c["ffn"]), r(T, c["ffn"])
    q, k, v = r(T, c["heads"], D), r(T, c["kv"], D), r(T, c["kv"], D)
    cu = torch.tensor([0, T // 2, T])
    pos = torch.arange(T)
    lm = r(c["vocab"], H) * H**-0.5
    lp_tokens = min(T, 64)
    tgt = torch.randint(0, c["vocab"], (lp_tokens,), generator=g)
    # decode: `decode` requests, each one new query against a 1-block-per-token cache of T keys
    B = c["decode"]
    kc, vc = k.reshape(T, 1, c["kv"], D), v.reshape(T, 1, c["kv"], D)
    table = torch.arange(T, dtype=torch.int32).expand(B, T).contiguous()
    seq = torch.full((B,), T)
    return {
        "linear(qkv)": lambda be: rk.linear(x, w_qkv, backend=be),
        "rms_norm": lambda be: rk.rms_norm(x, nw, 1e-6, backend=be),
        "swiglu": lambda be: rk.swiglu(gate, up, backend=be),
        "rope": lambda be: rk.rope(q, pos, 1e6, backend=be),
        "attention(prefill)": lambda be: rk.attention_varlen(q, k, v, cu, backend=be),
        "attention(decode)": lambda be: rk.attention_paged(q[:B], kc, vc, table, seq, torch.arange(B + 1), backend=be),
        f"linear_logprob({lp_tokens} tok)": lambda be: rk.linear_logprob(x[:lp_tokens], lm, tgt, 0.8, backend=be),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'size':<11} {'op':<28} {'strict ms':>10} {'native ms':>10} {'strict/native':>14}")
    with torch.no_grad():
        for size in args.sizes:
            for op, fn in _cases(SIZES[size], dtype).items():
                s = _time(lambda: fn("strict"), args.repeat) * 1e3
                n = _time(lambda: fn("native"), args.repeat) * 1e3
                rows.append(dict(size=size, op=op, strict_ms=round(s, 3), native_ms=round(n, 3), ratio=round(s / n, 2)))
                print(f"{size:<11} {op:<28} {s:>10.2f} {n:>10.2f} {s / n:>13.2f}x", flush=True)
    summary = dict(machine=platform.machine(), torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype, rows=rows)
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
