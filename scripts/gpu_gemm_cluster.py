#!/usr/bin/env python3
"""The row-parallel GEMM (o / down, 4 canonical K segments) as a cluster of CTAs sharing operand boxes through TMA
multicast (`rlkernel/backends/triton/gemm_cluster.py`, Triton >= 3.8), checked bit for bit and timed side by side in
one process against cuBLAS, the library's Gluon tile (`gemm_gluon.SEG_128x128`, the same kernel without a cluster)
and the strict Triton GEMM (the contract's reference bits) at the Qwen3-8B shapes.

    PYTHONPATH=<triton 3.8>:. python3 scripts/gpu_gemm_cluster.py --out DIR        # a GPU: bits and chain times
    PYTHONPATH=<triton 3.8>:. python3 scripts/gpu_gemm_cluster.py --compile-only   # any machine: sm_90 compiles
    python3 scripts/gpu_gemm_cluster.py --out DIR --hashes-only   # under the pinned Triton (3.6): the same inputs'
                                                                  # output hashes, to compare across the two Tritons

Rows: every variant's output against the strict Triton GEMM's (torch.equal and the rows that differ), run to run,
and each timer's chain time (a CUDA graph of 8 calls on 8 weights) in interleaved rounds; ratios are medians of the
rounds' ratios. `hashes` (sha256 of the outputs' bytes on seeded inputs) lets two processes on two Tritons compare.
Staging Triton 3.8 on the GPU machine: `scripts/gpu_triton_bundle.sh`. Session 43's records:
benchmarks/H100_session43/CALLS.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import triton  # noqa: E402

from rlkernel.backends.triton import gemm_cluster as GC  # noqa: E402
import gpu_gluon_gemm as GGS  # noqa: E402

from rlkernel.backends.triton import gemm_gluon as GG  # noqa: E402

SHAPES = {"o": (4096, 4096), "down": (12288, 4096)}  # K, N (Qwen3-8B's row-parallel layers)


def _sha(t) -> str:
    """The first 16 hex digits of the SHA-256 of a bf16 tensor's bit patterns. Not gpu_gluon_attn._sha (SHA-1): the
    hashes committed in benchmarks/H*_session43 are these, and later runs compare against them."""
    import torch

    return hashlib.sha256(t.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]


def _inputs(M: int, K: int, N: int, n: int):
    """Seeded on the CPU, so two processes (two Tritons) get the same bits."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1000 * M + K + N)
    a = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16)
    ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to("cuda", torch.bfloat16) for _ in range(n)]
    return a, ws


def _facts(kernel) -> dict:
    """gpu_gluon_gemm's facts (wgmma shapes, shared memory, ptxas usage) and the cluster's: multicast loads, remote
    mbarrier arrives."""
    ptx = kernel.asm["ptx"]
    return {**GGS.facts(kernel), "multicast_loads": ptx.count("multicast::cluster"),
            "remote_arrives": ptx.count("arrive.shared::cluster")}


def _row(gname: str, M: int, variants: list, rounds: int, timed: bool) -> dict:
    """One shape: the strict Triton GEMM's bits (the contract's reference), the library's Gluon tile and each cluster
    variant against them (bit patterns), then every kernel's chain time in interleaved rounds (where `timed`)."""
    import torch

    from rlkernel.backends.triton import gemm

    K, N = SHAPES[gname]
    a, ws = _inputs(M, K, N, 8)

    def bits(y):
        return y.view(torch.int16)

    def strict(i):  # the Triton kernel: the contract's reference bits
        with GG.off():
            return gemm.matmul(a, ws[i], k_segments=4, schedule="scratch")

    def gluon(i):  # the library's Gluon tile, launched directly (its gate names Triton 3.6)
        return GG.launch(a, ws[i], GG.SEG_128x128)

    ref = strict(0)
    row = {"gemm": gname, "M": M, "K": K, "N": N, "hashes": {"strict": _sha(ref)}, "variants": {}}
    timers = {"cublas": lambda i: torch.nn.functional.linear(a, ws[i]), "strict": strict}
    try:
        y = gluon(0)
        row["hashes"]["gluon_seg4_128x128_p"] = _sha(y)
        row["gluon_equal_to_strict"] = bool(torch.equal(bits(y), bits(ref)))
        timers["gluon_seg4_128x128_p"] = gluon
    except Exception as e:  # noqa: BLE001
        row["gluon_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    for name in variants:
        tile = GC.TILES[name]
        try:
            y = GC.launch(a, ws[0], tile)
            y2 = GC.launch(a, ws[0], tile, programs=3)  # three clusters walk every tile
            row["variants"][name] = {
                "equal_to_strict": bool(torch.equal(bits(y), bits(ref))),
                "rows_differ": int((bits(y) != bits(ref)).any(dim=1).sum()),
                "three_clusters_equal": bool(torch.equal(bits(y), bits(y2))),
                "run_to_run_equal": bool(torch.equal(y, GC.launch(a, ws[0], tile))),
                "hash": _sha(y)}
            timers[name] = lambda i, tile=tile: GC.launch(a, ws[i], tile)
        except Exception as e:  # noqa: BLE001
            row["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    if timed:
        ms = GGS.interleaved_ms(timers, rounds)
        row["times"] = {k: GGS.rounds_record(ms, k) for k in timers}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--hashes-only", action="store_true", help="the pinned Triton's side: output hashes only")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="512,1024,4096,16384")
    ap.add_argument("--gemms", default="o,down")
    ap.add_argument("--variants", default="seg4_c1x1,seg4_c2x1_dr6",
                    help="gemm_cluster.TILES names; seg4_c2x1 / c1x2 / c2x2 (cross-CTA mbarriers) faulted under Triton "
                         "3.8 on an H100 (session 43) and a fault poisons the process: run those alone, under `timeout`")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    res = {"triton": triton.__version__, "gemm_cluster": GC.unavailable() or "available", "compiled_sm90": {}}
    if not args.hashes_only and GC.unavailable() is None:
        GGS.record_compiles(variants, lambda n: _facts(GC.compile_sm90(GC.TILES[n])), res["compiled_sm90"])
    if not args.compile_only and GGS.gpu_header(res):
        t0 = time.time()
        for gname in args.gemms.split(","):
            for M in (int(m) for m in args.ms.split(",")):
                row = _row(gname, M, [] if args.hashes_only else variants, args.rounds, timed=not args.hashes_only)
                res["rows"].append(row)
                print(f"[{time.time() - t0:6.1f}s]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gemm_cluster_hashes.json" if args.hashes_only else "gemm_cluster.json"
    (out / name).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"rows": len(res.get("rows", [])), "compile_errors":
                      [k for k, v in res["compiled_sm90"].items() if "error" in v]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
