#!/usr/bin/env python3
"""The strict GEMM's tile configs against cuBLAS at small and mid row counts, bit-checked, two timers.

    python scripts/gpu_gemm_sweep.py [--out DIR] [--ms 1,16,64,256,1024,4096] [--shapes qkv,o,down,gate_up]
    python scripts/gpu_gemm_sweep.py --swiglu [--ms ...]     # the GEMM + SwiGLU epilogue (h200_gemm_sweep_swiglu.json)
    python scripts/gpu_gemm_sweep.py --segments 4 [--schedule fixup]   # K segments: candidates under one schedule

Why: issue 10 asks >= 0.90x cuBLAS at M >= 256; run 6 measured 0.38-0.90x there (and o at
M = 16 as slow as at M = 256, which a bandwidth-bound kernel should not be). On sm_90 a bf16
tile's bits do not depend on the tile config (contracts/gpu.py), so the config may follow M:
this script finds, per shape and M, the fastest candidate and checks that it gives the
contract kernel's bits (torch.equal on every output; a config that differs is reported and
never chosen).

Two timers, side by side in one process, for cuBLAS (F.linear) and every candidate:
  bench   triton.testing.do_bench: L2 flushed before every call, median (the harness's timer);
  chain   a CUDA graph of 8 calls, each on its own weight copy (256 MB and more: beyond L2),
          replayed; time per call. No host launch cost, no flush kernel: a model's layers
          back to back, as a decode step or a scoring forward runs them.

Writes DIR/h200_gemm_sweep.json (DIR: $OUT, else benchmarks/). Without CUDA it writes
{"skipped": reason} and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpu_strict_parity import GEMMS  # this script's directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
T0 = time.time()
SHAPES = {**GEMMS,  # (K, N) at Qwen3-8B (the harness's table)
          "q06_qkv": (1024, 4096), "q06_o": (2048, 1024), "q06_gate_up": (1024, 6144), "q06_down": (3072, 1024)}  # 0.6B
# K = 4,096 at widths around qkv's (N = 6,144: 96 tiles of 128 x 128 at M = 256 on 132 SMs): 32 to 264 such tiles. Time
# per call against the tile count tells whether a partial wave runs each tile at the full-wave rate (then qkv's gap is
# the idle SMs) or faster (then shared L2 / HBM bandwidth, not the idle SMs, bounds it)
SHAPES.update({f"k4096_n{n}": (4096, n) for n in (2048, 4096, 8192, 8448, 12288, 16896)})
# (block_m, block_n, block_k, stages, warps): block_m >= 64 throughout (wgmma; smaller tiles would lower to mma.sync)
CLUSTERED = [(64, 128, 128, 4, 4), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 256, 64, 4, 4)]  # also at num_ctas=2
CANDIDATES = [(64, 32, 128, 4, 4), (64, 32, 256, 4, 4), (64, 64, 128, 4, 4), (64, 64, 256, 3, 4), (64, 128, 64, 6, 4),
              (64, 128, 128, 4, 4), (64, 256, 64, 4, 4), (128, 64, 128, 4, 4), (128, 64, 128, 4, 8),
              (128, 128, 64, 4, 8), (128, 128, 128, 3, 8), (128, 256, 64, 3, 8)]

# two-accumulator tiles (block_m, block_n, block_n2, block_k, stages, warps): widths 96 and 192, so that a wave of 132 SMs
# divides the tiles where 64 / 128 / 256 columns leave most of a second wave idle (qkv at M = 256: N = 6,144 is 96
# tiles of 128 x 128, 192 of 64 x 128; 128 of 128 x 96 or 64 x 192)
DUAL = [(128, 64, 32, 128, 3, 8), (128, 64, 32, 64, 4, 8), (64, 64, 32, 128, 4, 4), (64, 128, 64, 64, 4, 4),
        (64, 128, 64, 128, 3, 4), (128, 128, 64, 64, 3, 8)]


def dual_name(bm, bn, bn2, bk, st, w) -> str:
    return f"{bm}x{bn}+{bn2}x{bk}_s{st}_w{w}"


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def chain_ms(fn_i, n=8, replays=20):
    """ms per call of fn_i(i) for i in 0..n-1, captured once as a CUDA graph and replayed."""
    import torch
    for i in range(n):  # compile / warm outside the capture
        fn_i(i)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n):
            fn_i(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):  # the warm-up's stream: what a call caches per stream (fixup's counters)
        for i in range(n):
            fn_i(i)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        e0.record()
        for _ in range(replays):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / (replays * n))
    return sorted(times)[len(times) // 2]


def bench_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=25)


def _timed(fn, fn_i, base: dict, ref=None) -> dict:
    """fn's two timers and their ratios to `base` (cuBLAS); with ref, whether fn() gives its bits; the registers a
    thread and the spilled bytes of the last _gemm_kernel fn launched (ptxas's figures; where it launched one)."""
    import torch
    from rlkernel.backends.triton import gemm
    gemm._LAST_KERNEL[0] = None
    y = fn()
    rec = {"equal": bool(torch.equal(y, ref))} if ref is not None else {}
    k = gemm._LAST_KERNEL[0]
    if k is not None:
        rec.update(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None))
    rec.update(bench_ms=round(bench_ms(fn), 4), chain_ms=round(chain_ms(fn_i), 4))
    for t in ("bench", "chain"):
        rec[f"{t}_ratio"] = round(base[f"{t}_ms"] / rec[f"{t}_ms"], 3)
    return rec


SEGMENT_SCHEDULES = ("launches", "registers", "fixup", "scratch")  # timed at the contract's tile in every row of a segments sweep


def sweep(shapes, ms, copies: int, only=None, segments: int = 1, schedule: str = "registers"):
    import torch
    import torch.nn.functional as F
    from rlkernel.backends.triton import gemm
    from rlkernel.contracts import gpu as G
    out = {}
    for name in shapes:
        k, n = SHAPES[name]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        cands = {"contract": (None, 1),
                 **{f"{bm}x{bn}x{bk}_s{st}_w{w}{'' if tma else '_ptr'}": (G.TileConfig(bm, bn, bk, st, w, tma=tma), 1)
                    for bm, bn, bk, st, w in CANDIDATES for tma in (True, False)},
                 **{f"{bm}x{bn}x{bk}_s{st}_w{w}_c2": (G.TileConfig(bm, bn, bk, st, w), 2) for bm, bn, bk, st, w in CLUSTERED},
                 **({dual_name(*d): (G.TileConfig(d[0], d[1], d[3], d[4], d[5], block_n2=d[2]), 1) for d in DUAL}
                    if segments == 1 else {})}
        if only:
            cands = {c: v for c, v in cands.items() if c in only}
        if n >= 16384:  # the wide class: its own tile and the wide candidates only
            cands = {c: v for c, v in cands.items() if v[0] is None or v[0].block_n + v[0].block_n2 >= 128}
        # segments > 1: the row-parallel layers' canonical K segments under `schedule` (default "registers", one
        # launch), each candidate against the contract's tile and against the definition (one GEMM per segment + the
        # tree); the contract's tile also under each of SEGMENT_SCHEDULES, and unsegmented (another contract: timed)
        kw = {"k_segments": segments, "schedule": schedule} if segments > 1 else {}
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = gemm.matmul(a, ws[0], **kw)
            flops = 2 * m * n * k
            row = {"contract_config": str(gemm.schedule_config("bfloat16", n, k, m, segments, kw.get("schedule")))
                   if segments > 1 else G.gemm_class(n, k, m),
                   "cublas": {"bench_ms": round(bench_ms(lambda: F.linear(a, ws[0])), 4),
                              "chain_ms": round(chain_ms(lambda i: F.linear(a, ws[i])), 4)}}
            if segments > 1:
                row["contract_equals_launches"] = bool(torch.equal(ref, gemm.matmul(a, ws[0], k_segments=segments,
                                                                                    schedule="launches")))
                for sc in SEGMENT_SCHEDULES:
                    kw3 = {"k_segments": segments, "schedule": sc}
                    try:
                        row[f"sched_{sc}"] = _timed(lambda: gemm.matmul(a, ws[0], **kw3),
                                                    lambda i: gemm.matmul(a, ws[i], **kw3), row["cublas"], ref)
                    except Exception as e:  # noqa: BLE001 -- recorded, the rest run
                        row[f"sched_{sc}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row["unsegmented"] = _timed(lambda: gemm.matmul(a, ws[0]), lambda i: gemm.matmul(a, ws[i]),
                                            row["cublas"])
            for cname, (cfg, ctas) in cands.items():
                kw2 = {**kw, "num_ctas": ctas}
                try:
                    rec = _timed(lambda: gemm.matmul(a, ws[0], config=cfg, **kw2),
                                 lambda i: gemm.matmul(a, ws[i], config=cfg, **kw2), row["cublas"], ref)
                    rec["chain_tflops"] = round(flops / rec["chain_ms"] / 1e9, 1)
                except Exception as e:  # noqa: BLE001 -- a candidate that fails to build is recorded, the rest run
                    rec = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row[cname] = rec
            ok = {c: r for c, r in row.items() if c in cands and r.get("equal")}  # configs: not the sched_ rows
            for t in ("bench", "chain"):
                best = max(ok, key=lambda c: ok[c][f"{t}_ratio"]) if ok else None
                row[f"best_{t}"] = {"config": best, "ratio": ok[best][f"{t}_ratio"] if ok else None}
            row["differ"] = sorted(c for c, r in row.items() if isinstance(r, dict) and r.get("equal") is False)
            out[f"{name}_M{m}"] = row
            log(name, m, "cublas", row["cublas"],
                "contract", {t: row.get("contract", {}).get(f"{t}_ratio") for t in ("bench", "chain")},
                "best", row["best_bench"], row["best_chain"], "differ", row["differ"],
                *(("schedules", {c[6:]: (r.get("bench_ratio"), r.get("chain_ratio")) for c, r in row.items()
                                 if c.startswith("sched_")}) if segments > 1 else ()))
            del a, ref
        del ws
        torch.cuda.empty_cache()
    return out


SWIGLU_CANDIDATES = [(64, 32, 256, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 3, 4), (128, 64, 64, 4, 8),
                     (128, 128, 64, 3, 8)]


def _silu_and_mul():
    """vLLM's fused silu-and-mul (stock vLLM's MLP activation) when vLLM is importable, else torch's composition."""
    import torch
    import torch.nn.functional as F
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
        op = torch.ops._C.silu_and_mul

        def act(y):
            out = torch.empty(y.shape[0], y.shape[1] // 2, device=y.device, dtype=y.dtype)
            op(out, y)
            return out
        return "vllm silu_and_mul", act
    except Exception:  # noqa: BLE001 -- no vLLM on this machine: the torch composition
        return "torch silu * up", lambda y: F.silu(y[:, :y.shape[1] // 2]) * y[:, y.shape[1] // 2:]


def sweep_swiglu(shapes, ms, copies: int, only=None):
    """The GEMM + SwiGLU epilogue (gemm.matmul_swiglu, rk.linear_swiglu's one launch) at the gate_up shapes: every
    candidate bit-checked against the strict composition (matmul, then swiglu: two launches) and chain-timed against it
    and against stock vLLM's (cuBLAS, then its silu_and_mul)."""
    import torch
    import torch.nn.functional as F
    from rlkernel.backends.triton import gemm
    from rlkernel.contracts import gpu as G
    act_name, act = _silu_and_mul()
    out = {"stock_activation": act_name}
    for name in shapes:
        k, n2 = SHAPES[name]
        ws = [torch.randn(n2, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        cands = {"contract": None, **{f"{bm}x{bn}x{bk}_s{st}_w{w}": G.TileConfig(bm, bn, bk, st, w)
                                      for bm, bn, bk, st, w in SWIGLU_CANDIDATES}}
        if only:
            cands = {c: v for c, v in cands.items() if c in only}
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def two_launches(i):  # the strict composition: matmul, then swiglu on its halves
                return gemm.swiglu(*gemm.matmul(a, ws[i]).chunk(2, dim=-1))
            ref = two_launches(0)
            row = {"contract_config": str(G.swiglu_config("bfloat16", n2 // 2, k, m)),
                   "stock": {"chain_ms": round(chain_ms(lambda i: act(F.linear(a, ws[i]))), 4)},
                   "strict_two_launches": {"chain_ms": round(chain_ms(two_launches), 4)}}
            row["strict_two_launches"]["ratio_vs_stock"] = round(row["stock"]["chain_ms"] / row["strict_two_launches"]["chain_ms"], 3)
            for cname, cfg in cands.items():
                try:
                    y = gemm.matmul_swiglu(a, ws[0], config=cfg)
                    rec = {"equal": bool(torch.equal(y, ref)),
                           "chain_ms": round(chain_ms(lambda i: gemm.matmul_swiglu(a, ws[i], config=cfg)), 4)}
                    rec["ratio_vs_stock"] = round(row["stock"]["chain_ms"] / rec["chain_ms"], 3)
                    rec["ratio_vs_two_launches"] = round(row["strict_two_launches"]["chain_ms"] / rec["chain_ms"], 3)
                except Exception as e:  # noqa: BLE001 -- a candidate that fails to build is recorded, the rest run
                    rec = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row[cname] = rec
            ok = {c: r for c, r in row.items() if c in cands and r.get("equal")}
            best = max(ok, key=lambda c: ok[c]["ratio_vs_stock"]) if ok else None
            row["best"] = {"config": best, "ratio_vs_stock": ok[best]["ratio_vs_stock"] if ok else None}
            row["differ"] = sorted(c for c in cands if row[c].get("equal") is False)
            out[f"{name}_M{m}"] = row
            log(name, m, "stock", row["stock"], "two launches", row["strict_two_launches"],
                "contract", {x: row["contract"].get(x) for x in ("equal", "ratio_vs_stock", "ratio_vs_two_launches")}
                if "contract" in row else None, "best", row["best"], "differ", row["differ"])
            del a, ref
        del ws
        torch.cuda.empty_cache()
    return out


def _schedules():
    """gemm.SCHEDULES, or None where triton is not installed (the sweep then only writes its skip record)."""
    try:
        from rlkernel.backends.triton.gemm import SCHEDULES
    except ImportError:
        return None
    return SCHEDULES


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--shapes", default="qkv,o,down,gate_up")
    ap.add_argument("--copies", type=int, default=8, help="weight copies in the chain timer (beyond L2)")
    ap.add_argument("--segments", type=int, default=1, choices=(1, 2, 4, 8),
                    help="canonical K segments (the row-parallel layers' one-launch schedule); 1: plain GEMMs")
    ap.add_argument("--schedule", default="registers", choices=_schedules(),
                    help="how the candidates run their K segments (gemm.matmul's schedule; --segments > 1 only)")
    ap.add_argument("--candidates", help="comma-separated candidate names to time (e.g. contract,64x128x128_s4_w4; 'dual': "
                                         "every two-accumulator tile, e.g. 128x64+32x128_s3_w8); default all")
    ap.add_argument("--swiglu", action="store_true",
                    help="the GEMM + SwiGLU epilogue at the gate_up shapes (default --shapes gate_up,q06_gate_up) against "
                         "the strict two launches and stock vLLM's cuBLAS + silu_and_mul")
    ap.add_argument("--name", help="the JSON file's name in --out (default by kind: h200_gemm_sweep.json, "
                                   "h200_gemm_sweep_segments<N>.json, h200_gemm_sweep_segments<N>_<schedule>.json "
                                   "when --schedule is not registers, h200_gemm_sweep_swiglu.json); two sweeps in one "
                                   "session need two names, or the second overwrites the first")
    args = ap.parse_args(argv)
    if args.swiglu and args.shapes == ap.get_default("shapes"):
        args.shapes = "gate_up,q06_gate_up"
    shapes = args.shapes.split(",")
    if args.swiglu and set(shapes) - {"gate_up", "q06_gate_up"}:
        ap.error(f"--swiglu runs at the gate_up shapes (gate_up, q06_gate_up), not {shapes}")
    if set(shapes) - set(SHAPES):
        ap.error(f"unknown shapes {sorted(set(shapes) - set(SHAPES))}; known: {sorted(SHAPES)}")
    ms = [int(x) for x in args.ms.split(",")]
    only = set(args.candidates.split(",")) if args.candidates else None
    if only and "dual" in only:  # the group: every two-accumulator candidate
        only = (only - {"dual"}) | {dual_name(*d) for d in DUAL}
    if args.swiglu:
        known = {"contract", *(f"{bm}x{bn}x{bk}_s{st}_w{w}" for bm, bn, bk, st, w in SWIGLU_CANDIDATES)}
    else:
        known = {"contract", *(f"{bm}x{bn}x{bk}_s{st}_w{w}{sfx}" for bm, bn, bk, st, w in CANDIDATES for sfx in ("", "_ptr")),
                 *(f"{bm}x{bn}x{bk}_s{st}_w{w}_c2" for bm, bn, bk, st, w in CLUSTERED),
                 *(dual_name(*d) for d in DUAL)}
    if only and only - known:
        ap.error(f"unknown candidates {sorted(only - known)}; known: {sorted(known)}")
    if any(m < 1 for m in ms):
        ap.error("--ms: row counts must be >= 1")
    out = Path(args.out)
    if args.schedule != "registers" and args.segments == 1:
        ap.error("--schedule: how K segments run; give --segments 2, 4 or 8")
    name = "h200_gemm_sweep.json" if args.segments == 1 else f"h200_gemm_sweep_segments{args.segments}.json"
    if args.segments > 1 and args.schedule != "registers":
        name = f"h200_gemm_sweep_segments{args.segments}_{args.schedule}.json"
    if args.swiglu:
        if args.segments != 1:
            ap.error("--swiglu has no K segments")
        name = "h200_gemm_sweep_swiglu.json"
    if args.name:
        if "/" in args.name or not args.name.endswith(".json"):
            ap.error(f"--name: a file name ending in .json, not {args.name!r}")
        name = args.name
    import torch
    if not torch.cuda.is_available():
        out.mkdir(parents=True, exist_ok=True)
        res = {"skipped": "no CUDA device"}
        (out / name).write_text(json.dumps(res))
        print(json.dumps(res))
        return 0
    import triton
    from vime.stamp import code_stamp
    res = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "triton": triton.__version__, "code": code_stamp(), "command": " ".join(sys.argv),
           "timers": {"bench": "do_bench, L2 flushed, median", "chain": f"CUDA graph of {args.copies} calls on distinct weights"}}
    res["segments"] = args.segments
    res["schedule"] = args.schedule if args.segments > 1 else None
    if args.swiglu:
        res["swiglu"] = sweep_swiglu(shapes, ms, args.copies, only)
    else:
        res["gemm"] = sweep(shapes, ms, args.copies, only, args.segments, args.schedule)
    res["elapsed_s"] = round(time.time() - T0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(res, indent=1))
    print(json.dumps({"written": str(out / name), "elapsed_s": res["elapsed_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
