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
import statistics
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--hashes-only", action="store_true", help="the pinned Triton's side: output hashes only")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="512,1024,4096,16384")
    ap.add_argument("--gemms", default="o,down")
    ap.add_argument("--variants", default="seg4_c1x1,seg4_c2x1_g",
                    help="gemm_cluster.TILES names; seg4_c2x1 / c1x2 / c2x2 (cross-CTA mbarriers) faulted under Triton "
                         "3.8 on an H100 (session 43) and a fault poisons the process: run those alone")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    res = {"triton": triton.__version__, "gemm_cluster": GC.unavailable() or "available", "compiled_sm90": {}}
    if not args.hashes_only and GC.unavailable() is None:
        GGS.record_compiles(variants, lambda n: _facts(GC.compile_sm90(GC.TILES[n])), res["compiled_sm90"])
    if not args.compile_only:
        import torch

        if not torch.cuda.is_available():
            res["skipped"] = "no CUDA device"
        else:
            from gpu_gemm_sweep import chain_ms

            from rlkernel.backends.triton import gemm

            res["device"] = torch.cuda.get_device_name()
            res["timer"] = "chain: a CUDA graph of 8 calls on 8 weights, ms per call (scripts/gpu_gemm_sweep.chain_ms)"
            res["rows"] = []
            t0 = time.time()
            for gname in args.gemms.split(","):
                K, N = SHAPES[gname]
                for M in (int(m) for m in args.ms.split(",")):
                    a, ws = _inputs(M, K, N, 8)

                    def strict(i, a=a):  # the Triton kernel: the contract's reference bits
                        with GG.off():
                            return gemm.matmul(a, ws[i], k_segments=4, schedule="scratch")

                    def gluon(i, a=a):  # the library's Gluon tile, launched directly (its gate names Triton 3.6)
                        return GG.launch(a, ws[i], GG.SEG_128x128)

                    ref = strict(0)
                    row = {"gemm": gname, "M": M, "K": K, "N": N, "hashes": {"strict": _sha(ref)}, "variants": {}}
                    timers = {"cublas": lambda i, a=a: torch.nn.functional.linear(a, ws[i]), "strict": strict}
                    try:
                        y = gluon(0)
                        row["hashes"]["gluon_seg4_128x128_p"] = _sha(y)
                        row["gluon_equal_to_strict"] = bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))
                        timers["gluon_seg4_128x128_p"] = gluon
                    except Exception as e:  # noqa: BLE001
                        row["gluon_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    if not args.hashes_only:
                        for name in variants:
                            tile = GC.TILES[name]
                            try:
                                y = GC.launch(a, ws[0], tile)
                                y2 = GC.launch(a, ws[0], tile, programs=3)  # three clusters walk every tile
                                row["variants"][name] = {
                                    "equal_to_strict": bool(torch.equal(y.view(torch.int16), ref.view(torch.int16))),
                                    "rows_differ": int((y.view(torch.int16) != ref.view(torch.int16)).any(dim=1).sum()),
                                    "three_clusters_equal": bool(torch.equal(y.view(torch.int16), y2.view(torch.int16))),
                                    "run_to_run_equal": bool(torch.equal(y, GC.launch(a, ws[0], tile))),
                                    "hash": _sha(y)}
                                timers[name] = lambda i, a=a, tile=tile: GC.launch(a, ws[i], tile)
                            except Exception as e:  # noqa: BLE001
                                row["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
                        ms = {k: [] for k in timers}
                        for _ in range(args.rounds):  # interleaved rounds, every timer in each
                            for k, fn in timers.items():
                                ms[k].append(chain_ms(fn))
                        med = statistics.median

                        def rec(k):
                            return {"ms": round(med(ms[k]), 4),
                                    "vs_cublas": round(med([c / t for c, t in zip(ms["cublas"], ms[k])]), 3),
                                    "vs_cublas_rounds": [round(c / t, 3) for c, t in zip(ms["cublas"], ms[k])]}
                        row["times"] = {k: rec(k) for k in timers}
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
