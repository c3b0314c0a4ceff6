#!/usr/bin/env python3
"""An experiment, not a contract (session 28): two GEMM tiles in Gluon that the Triton kernel cannot express, each
checked bit for bit against rlkernel's strict GEMM and timed against it and cuBLAS at the Qwen3-8B shapes.

1. **Wave-balanced tiles for the column-parallel GEMMs at small M** (qkv 0.67-0.73x cuBLAS at M = 256): session 28's
   `gpu_cublas_probe.py` found cuBLAS's kernel there is `nvjet_sm90_tst_96x128_64x7_2x1` (and `192x128` for gate_up at
   M = 256, qkv at 1,024): tiles of 96 / 192 columns, so N = 6,144 makes 2 x 64 = 128 work items on 132 SMs (the
   strict table's 128 x 128: 96, a 0.73 wave), no split of K. Gluon (like Triton) refuses block shapes that are not
   powers of two, so a 96-column tile here is two accumulators, 64 + 32 columns (192: 128 + 64), each a wgmma chain over
   the same A stage (session 19's Triton two-accumulator tile lost, 0.34-0.52x; call 2 here also loaded A into registers
   once for both chains: other bits, dropped).
2. **The row-parallel GEMM's canonical K segments in a warp-specialised consumer** (o / down with 4 segments:
   production's scratch / registers / fixup schedules 0.56-0.79x cuBLAS at M >= 256): the producer warp streams every
   K step's loads without a break, the consumer runs each segment's wgmma chain from zero and folds it into the tree
   ((s0 + s1) + (s2 + s3)) in registers as it ends (the statically unrolled segment loop: no pipeline restarts).

Every tile's K order is the contract's (fp32 accumulate, BK = 64 steps in order, wgmma k16 in order inside a step), so
the bits should equal `gemm.matmul` (segments: `gemm.matmul(..., k_segments=4)`): `equal_to_strict` (torch.equal) says.

    python3 scripts/gpu_gluon_gemm.py --compile-only    # any machine: compile every tile for sm_90; ptxas registers / spills
    python3 scripts/gpu_gluon_gemm.py --out DIR         # an H200: bits and chain times; writes DIR/h200_gluon_gemm.json

Since 031c705 the kernel is the library's (`rlkernel/backends/triton/gemm_gluon.py`); each row also times the library
as shipped (`gemm.matmul` with ops.segment_schedule's pick) against the Triton kernel (RLKERNEL_GEMM_GLUON off).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import triton  # noqa: E402

from rlkernel.backends.triton import gemm_gluon as GG  # noqa: E402
from rlkernel.backends.triton import gemm_park as GP  # noqa: E402

def _t(name, *a, **k):
    return GG.Tile(name, *a, **k)


# name -> the library's Tile (rlkernel/backends/triton/gemm_gluon.py: the kernel these rows time). Session 28 call 2
# also timed a variant loading A into registers once for both accumulators (`_areg`): other bits, no faster — dropped
# (its records: benchmarks/h200_session28/call2); call 2 ran this script's own copy of the kernel (ed941ed).
TILES = {t.name: t for t in (
    GG.ONE_WAVE, GG.TWO_WAVES, GG.SEG_64x128, GG.SEG_128x128,  # the library's (64x192_s7, 128x192_s5_p, ...)
    _t("64x192_s6", 64, 128, 64, 6, 1, 4), _t("128x192_s5", 128, 128, 64, 5, 1, 8),  # the library's to session 48
    _t("128x96", 128, 64, 32, 5, 1, 8), _t("128x96_s4", 128, 64, 32, 4, 1, 8), _t("128x96_s6", 128, 64, 32, 6, 1, 8),
    _t("128x96_s7", 128, 64, 32, 7, 1, 8), _t("128x96_s8", 128, 64, 32, 8, 1, 8), _t("64x96", 64, 64, 32, 6, 1, 4),
    _t("64x192", 64, 128, 64, 5, 1, 4), _t("128x192", 128, 128, 64, 4, 1, 8),
    _t("128x128", 128, 128, 0, 4, 1, 8),
    _t("64x128", 64, 128, 0, 6, 1, 4), _t("seg4_128x64", 128, 64, 0, 6, 4, 8),
    # session 29: the tile walk in groups of 8 M tiles (L2 reuse at M = 16,384, where A alone is 128-400 MB), one
    # program per SM walking its tiles (the next tile's loads run under this one's epilogue). (A segment's first
    # wgmma issued before the last segment's fold spilled on sm_90: not kept.) Call 1 took seg4_128x128_p into the
    # library (pick: M > 256).
    _t("seg4_128x128", 128, 128, 0, 4, 4, 8), _t("seg4_128x128_g8", 128, 128, 0, 4, 4, 8, group_m=8),
    _t("seg4_64x128_p", 64, 128, 0, 6, 4, 4, persistent=True, group_m=8),
    _t("128x128_p", 128, 128, 0, 4, 1, 8, persistent=True, group_m=8),
    # session 29 call 5: lm_head (N = 151,936 = 128 x 1,187: no 192- or 256-column tile divides it; the last N tile
    # partial) at M = 256, where the Triton table reads 0.86x
    _t("128x256", 128, 128, 128, 4, 1, 8), _t("128x256_p", 128, 128, 128, 4, 1, 8, persistent=True, group_m=8),
    _t("64x192_s6_p", 64, 128, 64, 6, 1, 4, persistent=True, group_m=8),
    # after session 29's device time (compiled for sm_90 on the CPU: no spills, 216 KB of shared memory): segments
    # at 128 x 192 / 128 x 160 (two accumulators; the tree's waiting partial in shared memory, fp32; 3 stages), where
    # 128 x 128 (0.79-0.89x for o at M >= 512, its unsegmented twin no faster) is the tile that caps them. Lost in
    # session 32; since session 45 gemm_park's kernel builds them (run() launches them there)
    GP.TILES["seg4_128x192_p"], GP.TILES["seg4_128x160_p"],
    # session 33: Nsight Compute on the H100 read the segmented 128 x 128 tile's tensor pipe 74 % active (cuBLAS's
    # 256 x 128: 95 %), shared memory's LSU pipe only ~52 % busy, and 32-35 % of warp stalls "long scoreboard" (the
    # consumers waiting on a stage's data): its 4 stages of 32 KB hold ~2,000 cycles of wgmma ahead, cuBLAS's 4 of
    # 48 KB twice that. More stages for the same tile (the same bits: stages move no arithmetic)
    _t("seg4_128x128_p_s5", 128, 128, 0, 5, 4, 8, persistent=True, group_m=8),
    _t("seg4_128x128_p_s6", 128, 128, 0, 6, 4, 8, persistent=True, group_m=8),
    _t("seg4_128x128_p_s7", 128, 128, 0, 7, 4, 8, persistent=True, group_m=8),
    # session 34, a probe for the attention prefill (its q.k^T is an m64n64 wgmma chain with both operands in shared
    # memory): the same GEMM with 64-column tiles (m64n64k16, as q.k^T) beside 128x128_p (m64n128k16): the rate of
    # the narrow wgmma; timing only (unsegmented: other bits than the o layer's segments)
    _t("128x64_p_s6", 128, 64, 0, 6, 1, 8, persistent=True, group_m=8),
    # session 49, the column-parallel rows at M = 256 that miss 0.90x on an H100 (qkv 0.880, gate_up 0.886x in
    # session 48's harness; the H200 read 0.93 / 0.91x): a second K step of wgmmas in flight (`depth`), and
    # programmatic dependent launch (`pdl`: 1 every load after griddepcontrol.wait, 2 the first stages of W before it
    # — an experiment only, gemm_gluon.PDL_MODES), on the library's tiles and their neighbours. Same arithmetic.
    _t("64x192_s4", 64, 128, 64, 4, 1, 4),
    _t("64x192_s6_d2", 64, 128, 64, 6, 1, 4, depth=2), _t("64x192_s7_d2", 64, 128, 64, 7, 1, 4, depth=2),
    _t("64x192_s6_pdl1", 64, 128, 64, 6, 1, 4, pdl=1), _t("64x192_s6_pdl2", 64, 128, 64, 6, 1, 4, pdl=2),
    _t("64x192_s6_d2_pdl1", 64, 128, 64, 6, 1, 4, depth=2, pdl=1),
    _t("128x96_s7_pdl1", 128, 64, 32, 7, 1, 8, pdl=1),
    _t("128x192_s5_d2", 128, 128, 64, 5, 1, 8, depth=2), _t("128x192_s5_pdl1", 128, 128, 64, 5, 1, 8, pdl=1),
    _t("128x192_s5_pdl2", 128, 128, 64, 5, 1, 8, pdl=2),
    _t("128x192_s5_p_pdl1", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, pdl=1),
    _t("128x192_s5_p_d2_pdl1", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, depth=2, pdl=1),
    _t("128x128_pdl1", 128, 128, 0, 4, 1, 8, pdl=1),
    # session 50, gate_up at M = 256 at the H100's power cap (session 49: cuBLAS's 1 x 2 cluster shares W's boxes
    # between the two M tiles): one CTA over both M tiles — 256 x 192 with two consumer warpgroups, each 128 rows of
    # 192 accumulator registers (ptxas: no spills, unlike session 49's four warpgroups at 120 registers), one wave of
    # 128 tiles and W through L2 once; and the two-wave tile with 4 stages (fewer shared-memory bytes in flight).
    # All lost (an H100, 7 rounds): gate_up M = 256 256x192 s4 / s3 0.867 / 0.804, 128x192 s4 p 0.819 against the
    # library's 0.875-0.887x; 256 x 192 ran at 1,500 MHz against 1,380 at the same 700 W and no faster
    # (benchmarks/H100_session50/CALLS.md)
    _t("256x192_s4_p", 256, 128, 64, 4, 1, 8, persistent=True, group_m=8),
    _t("256x192_s3_p", 256, 128, 64, 3, 1, 8, persistent=True, group_m=8),
    _t("128x192_s4_p", 128, 128, 64, 4, 1, 8, persistent=True, group_m=8),
    # below the power cap, gate_up at M = 256 streams W ~9 % slower than cuBLAS (session 50, call 14): an L2 prefetch
    # of W's next 4 K steps, 4-32 steps ahead of the ring's TMA loads (gemm_gluon `prefetch`: a hint, no bit;
    # `gpu_session.py gemm_prefetch`), also on 256 x 192. All lost, bit-equal (an H100, session 51): one request a W
    # row 0.45-0.53x at gate_up M = 256, one tensor-map request a round 0.64-0.76x, against 0.89x without
    # (benchmarks/H100_session51/CALLS.md)
    _t("128x192_s5_p_pf4", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, prefetch=4),
    _t("128x192_s5_p_pf8", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, prefetch=8),
    _t("128x192_s5_p_pf16", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, prefetch=16),
    _t("128x192_s5_p_pf32", 128, 128, 64, 5, 1, 8, persistent=True, group_m=8, prefetch=32),
    _t("64x192_s7_pf8", 64, 128, 64, 7, 1, 4, prefetch=8),
    _t("256x192_s4_p_pf8", 256, 128, 64, 4, 1, 8, persistent=True, group_m=8, prefetch=8))}
# (a 64 x 256 segmented tile spills on sm_90: 3 live accumulators of 128 registers a thread)
# which tiles each shape tries (segments: the row-parallel layers). Session 29 call 2 timed 128x96 s5-s8, 64x192 s5 /
# s6, 128x192 s4 / s5 at qkv and gate_up, and seg4_64x128 / seg4_128x128 (one program a tile) / _p / 128x128_p at o /
# down (its records: benchmarks/h200_session29/call2); call 3 confirms the picks. The 5-7-stage segmented tiles and
# 128x64_p_s6 were timed in sessions 34-35 and lost (H200_NOTES); they stay in TILES (compiled by --compile-only), out of
# the timed PLAN.
PLAN = {"qkv": ["64x192_s6", "64x192_s7", "128x96_s6", "128x192_s5", "128x192"],
        "gate_up": ["128x192_s5", "128x192"],
        "o": ["seg4_128x128_p", "128x128_p"],
        "down": ["seg4_128x128_p", "128x128_p"],
        "lm_head": ["128x128", "128x128_p", "128x192_s5", "128x192_s5_p", "128x256", "128x256_p", "64x192_s6",
                    "64x192_s6_p"]}


def facts(kernel) -> dict:
    import re

    from gpu_gluon_attn import ptxas_usage

    ptx = kernel.asm["ptx"]
    return {"wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": "setmaxnreg" in ptx,
            "shared_bytes": kernel.metadata.shared, "ptxas": ptxas_usage(ptx)}


def record_compiles(names, build, into: dict) -> None:
    """into[name] = build(name) (a compiled kernel's facts) for each name, or the error a tile this Triton cannot
    build raised (recorded, never fatal); each printed as it lands. Shared with gpu_gemm_cluster.py."""
    for name in names:
        try:
            into[name] = build(name)
        except Exception as e:  # noqa: BLE001 -- recorded
            into[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        print(name, json.dumps(into[name]), flush=True)


def gpu_header(res: dict) -> bool:
    """On a CUDA machine: res gets the device, the timer's description and an empty `rows`, and True; else
    res["skipped"] and False. Shared with gpu_gemm_cluster.py."""
    import torch

    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
        return False
    res["device"] = torch.cuda.get_device_name()
    res["timer"] = "chain: a CUDA graph of 8 calls on 8 weights, ms per call (scripts/gpu_gemm_sweep.chain_ms)"
    res["rows"] = []
    return True


def interleaved_ms(timers: dict, rounds: int) -> dict:
    """name -> its chain time in each of `rounds` rounds, every timer once a round in order (session 29 call 1: one
    kernel's chain time moved ~10 % between two timings in one process)."""
    from gpu_gemm_sweep import chain_ms

    ms = {k: [] for k in timers}
    for _ in range(rounds):
        for k, fn in timers.items():
            ms[k].append(chain_ms(fn))
    return ms


def rounds_record(ms: dict, k: str, bases=("cublas",)) -> dict:
    """Timer k's median ms, the medians of its per-round ratios to each base (base ms / k ms: > 1 is faster than the
    base) and its per-round ratios to cuBLAS."""
    med = statistics.median
    rec = {"ms": round(med(ms[k]), 4)}
    rec.update({f"vs_{b}": round(med([c / t for c, t in zip(ms[b], ms[k])]), 3) for b in bases})
    rec["vs_cublas_rounds"] = [round(c / t, 3) for c, t in zip(ms["cublas"], ms[k])]
    return rec


def run(a, w, name):
    """a [M, K] bf16 @ w [N, K]^T -> [M, N] bf16 on the GPU through tile `name` (the library's launch)."""
    t = TILES[name]
    if isinstance(t, GP.ParkTile):  # the two-accumulator segmented tiles
        return GP.launch(a, w, t)
    if a.shape[1] % (GG.BK * t.segs):
        raise ValueError(f"{name}: K={a.shape[1]} does not divide into its tile's steps and segments")
    return GG.launch(a, w, t)


def compile_sm90(name):
    t = TILES[name]
    return GP.compile_sm90(t) if isinstance(t, GP.ParkTile) else GG.compile_sm90(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="256,512,1024,4096", help="rows for qkv / gate_up")
    ap.add_argument("--gemms", default="qkv,gate_up,o,down,lm_head", help="which of PLAN's GEMMs")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, every timer in each")
    ap.add_argument("--seg-ms", default="256,512,1024,4096,16384", help="rows for o / down (4 segments)")
    ap.add_argument("--plan", default="",
                    help="GEMM=tile,tile;GEMM=...: these tiles instead of PLAN's for each GEMM named")
    ap.add_argument("--device-us", action="store_true",
                    help="each row also records every timer's kernels and device microseconds (torch.profiler)")
    args = ap.parse_args(argv)
    plan = dict(PLAN)
    for part in filter(None, args.plan.split(";")):
        g, _, names = part.partition("=")
        if g not in PLAN or not names or any(n not in TILES for n in names.split(",")):
            ap.error(f"--plan {part!r}: GEMM one of {sorted(PLAN)}, tiles of {sorted(TILES)}")
        plan[g] = names.split(",")
    res = {"triton": triton.__version__, "compiled_sm90": {}}
    wanted = {t for g in args.gemms.split(",") for t in plan.get(g, [])}
    names = [n for n in TILES if n in wanted or args.compile_only]  # only the rows' tiles (each compile ~2 s here)
    record_compiles(names, lambda n: facts(compile_sm90(n)), res["compiled_sm90"])
    if not args.compile_only and gpu_header(res):
        import torch

        from gpu_strict_parity import GEMMS
        from rlkernel.backends.triton import gemm, ops

        t0 = time.time()
        for gname, tiles in plan.items():
            if gname not in args.gemms.split(","):
                continue
            K, N = GEMMS[gname]
            segs = 4 if gname in ("o", "down") else 1
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(8)]
            for M in (int(m) for m in (args.seg_ms if segs > 1 else args.ms).split(",")):
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                sched = "scratch" if segs > 1 else None  # the Triton kernel's schedule before session 28
                lib_sched = ops.segment_schedule(M, N, K, segs) if segs > 1 else None

                def strict(i, a=a, sched=sched, segs=segs):  # the Triton kernel: the reference bits and time
                    with GG.off():
                        return gemm.matmul(a, ws[i], k_segments=segs, schedule=sched)

                def library(i, a=a, segs=segs, lib_sched=lib_sched):
                    return gemm.matmul(a, ws[i], k_segments=segs, schedule=lib_sched)

                ref = strict(0)
                row = {"gemm": gname, "M": M, "K": K, "N": N, "k_segments": segs, "strict_schedule": sched,
                       "tiles": {}}
                timers = {"cublas": lambda i, a=a: torch.nn.functional.linear(a, ws[i]), "strict": strict}
                if segs > 1:  # the unsegmented strict GEMM: what the segments cost
                    def plain(i, a=a):
                        with GG.off():
                            return gemm.matmul(a, ws[i])
                    timers["strict_plain"] = plain
                # the library as shipped: gemm.matmul with ops.segment_schedule's pick (a Gluon tile where
                # gemm_gluon.pick names one, after its first-use check)
                tile = GG.choose(a, ws[0], segs, None, None)
                y = library(0)
                row["library"] = {"schedule": lib_sched, "gluon_tile": tile and tile.name,
                                  "equal_to_strict": bool(torch.equal(y, ref))}
                timers["library"] = library
                for name in tiles:
                    try:
                        y = run(a, ws[0], name)
                        row["tiles"][name] = {"equal_to_strict": bool(torch.equal(y, ref)),
                                              "rows_differ": int((y != ref).any(dim=1).sum()),
                                              "run_to_run_equal": bool(torch.equal(y, run(a, ws[0], name)))}
                        timers[name] = lambda i, a=a, name=name: run(a, ws[i], name)
                    except Exception as e:  # noqa: BLE001
                        row["tiles"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                ms = interleaved_ms(timers, args.rounds)
                med = statistics.median

                def rec(k):
                    return rounds_record(ms, k, ("cublas", "strict"))
                row["cublas_ms"] = round(med(ms["cublas"]), 4)
                row["strict_ms"] = round(med(ms["strict"]), 4)
                if segs > 1:
                    row["strict_plain_ms"] = round(med(ms["strict_plain"]), 4)
                row["library"].update(rec("library"))
                for name in tiles:
                    if name in ms:
                        row["tiles"][name].update(rec(name))
                row["strict_vs_cublas"] = rec("strict")["vs_cublas"]
                if args.device_us:  # what each timer launches and its device time, one call at a time (no graph)
                    from gpu_cublas_probe import kernels_of
                    row["device_us"] = {k: kernels_of(lambda fn=fn: fn(0)) for k, fn in timers.items()}
                res["rows"].append(row)
                print(f"[{time.time() - t0:6.1f}s]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res["gemm_gluon"] = GG.describe()  # the first-use checks' outcomes
    (out / "h200_gluon_gemm.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"tiles": len(res["compiled_sm90"]), "rows": len(res.get("rows", [])),
                      "errors": [k for k, v in res["compiled_sm90"].items() if "error" in v]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
