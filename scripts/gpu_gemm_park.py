#!/usr/bin/env python3
"""The row-parallel GEMM (o / down, 4 canonical K segments) at 128 x 256 with the segment tree's partials parked in
shared memory and L2 (`rlkernel/backends/triton/gemm_park.py`), checked bit for bit and timed side by side in one
process against cuBLAS, the library's Gluon tile (`gemm_gluon.SEG_128x128`, 128 x 128: the tile it would replace)
and the unsegmented 128 x 256 tile (`gemm_gluon.VOCAB`: the ceiling, other bits) at the Qwen3-8B shapes.

    python3 scripts/gpu_gemm_park.py --out DIR           # a GPU: bits and chain times -> DIR/gemm_park.json
    python3 scripts/gpu_gemm_park.py --compile-only      # any machine: sm_90 compiles, registers, shared memory

Bits: each variant's output against the strict Triton GEMM's (`gemm.matmul(..., k_segments=4)`, bit patterns), with
three programs walking every tile (the slots reused across tiles) and run to run; `hashes` are gpu_gemm_cluster's
(seeded inputs: comparable with benchmarks/H100_session43-44). Times: chain (a CUDA graph of 8 calls on 8 weights) in
interleaved rounds; ratios are medians of the rounds' ratios. `plain_128x256_k32s4` (one chain over K, the same
ring) is checked against the unsegmented strict GEMM: what the parking costs is its time against seg4_128x256_k32s4's.
`seg2_128x256_k32s4` (2 canonical segments: `rlkernel.row_segments=2`) is checked against the strict GEMM at 2
segments and timed beside gemm_gluon's kernel at 2 segments (`gluon_seg2_128x128_p`; the library takes 4 only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import triton  # noqa: E402

import gpu_gemm_cluster as GCS  # noqa: E402
import gpu_gluon_gemm as GGS  # noqa: E402
from rlkernel.backends.triton import gemm_gluon as GG  # noqa: E402
from rlkernel.backends.triton import gemm_park as GP  # noqa: E402

# gemm_gluon's persistent 128 x 128 tile at 2 canonical segments (the library takes 4 only): seg2_128x256's baseline
SEG2_128x128 = GG.Tile("seg2_128x128_p", 128, 128, 0, 4, 2, 8, persistent=True, group_m=8)


def _row(gname: str, M: int, variants: list, rounds: int) -> dict:
    import torch

    from rlkernel.backends.triton import gemm

    K, N = GCS.SHAPES[gname]
    a, ws = GCS._inputs(M, K, N, 8)

    def bits(y):
        return y.view(torch.int16)

    refs = {}  # the strict GEMM's output by segment count (1: the diagnostic's, 2: row_segments=2), made as needed

    def strict(segs):
        if segs not in refs:
            with GG.off():
                refs[segs] = gemm.matmul(a, ws[0], k_segments=segs, schedule="scratch" if segs > 1 else None)
        return refs[segs]

    ref = strict(4)
    row = {"gemm": gname, "M": M, "K": K, "N": N, "hashes": {"strict": GCS._sha(ref)}, "variants": {}}
    timers = {"cublas": lambda i: torch.nn.functional.linear(a, ws[i]),
              "gluon_seg4_128x128_p": lambda i: GG.launch(a, ws[i], GG.SEG_128x128),
              "plain_128x256_p": lambda i: GG.launch(a, ws[i], GG.VOCAB)}  # unsegmented: the ceiling, other bits
    if any(GP.TILES[n].segs == 2 for n in variants):  # the library's kernel at 2 segments: what seg2 would replace
        timers["gluon_seg2_128x128_p"] = lambda i: GG.launch(a, ws[i], SEG2_128x128)
    row["gluon_equal_to_strict"] = bool(torch.equal(bits(timers["gluon_seg4_128x128_p"](0)), bits(ref)))
    for name in variants:
        tile = GP.TILES[name]
        try:
            y = GP.launch(a, ws[0], tile)
            y3 = GP.launch(a, ws[0], tile, programs=3)
            want = strict(tile.segs)
            row["variants"][name] = {
                "segments": tile.segs,
                "equal_to_strict": bool(torch.equal(bits(y), bits(want))),
                "rows_differ": int((bits(y) != bits(want)).any(dim=1).sum()),
                "three_programs_equal": bool(torch.equal(bits(y), bits(y3))),
                "run_to_run_equal": bool(torch.equal(bits(y), bits(GP.launch(a, ws[0], tile)))),
                "hash": GCS._sha(y)}
            timers[name] = lambda i, tile=tile: GP.launch(a, ws[i], tile)
        except Exception as e:  # noqa: BLE001 -- recorded; the other variants still run
            row["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    if "gluon_seg2_128x128_p" in timers:
        row["gluon_seg2_equal_to_strict"] = bool(torch.equal(bits(timers["gluon_seg2_128x128_p"](0)), bits(strict(2))))
    ms = GGS.interleaved_ms(timers, rounds)
    row["times"] = {k: GGS.rounds_record(ms, k, ("cublas", "gluon_seg4_128x128_p")) for k in timers}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="512,1024,4096,16384")
    ap.add_argument("--gemms", default="o,down")
    ap.add_argument("--variants", default=",".join(n for n in GP.TILES if n != "seg4_128x160_p"),
                    help="gemm_park.TILES names (default: all but session 32's 128 x 160, whose loss is on record)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in GP.TILES]
    if unknown:
        ap.error(f"unknown variants {unknown}; gemm_park.TILES: {sorted(GP.TILES)}")
    res = {"triton": triton.__version__, "gemm_park": GP.unavailable() or "available", "compiled_sm90": {}}
    if GP.unavailable() is None:
        GGS.record_compiles(variants, lambda n: {**GGS.facts(GP.compile_sm90(GP.TILES[n])),
                                                 "ring_and_partial_bytes": GP.TILES[n].shared_bytes},
                            res["compiled_sm90"])
    if not args.compile_only and GP.unavailable() is None and GGS.gpu_header(res):
        t0 = time.time()
        for gname in args.gemms.split(","):
            for M in (int(m) for m in args.ms.split(",")):
                row = _row(gname, M, variants, args.rounds)
                res["rows"].append(row)
                print(f"[{time.time() - t0:6.1f}s]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_park.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"rows": len(res.get("rows", [])), "compile_errors":
                      [k for k, v in res["compiled_sm90"].items() if "error" in v]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
