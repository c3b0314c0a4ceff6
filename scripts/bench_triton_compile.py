#!/usr/bin/env python3
"""Does Triton compile rlkernel's kernels in parallel threads? (the design question of a compile-ahead for the cold first
strict step on a GPU: ~125 s of compiles on a fresh H200 machine, sessions 22 and 24).

Compiles the strict GEMM for sm_90 (Triton ships ptxas: no GPU needed) at 8 tile configs, once serially and once in a
thread pool, each into its own fresh Triton cache, in one process; prints the wall times and their ratio, writes JSON.
Also the seconds of the tree-sum kernel's compile at each (C, R) that `reduce._shape` gives (serially, a fresh cache):
its slowest class once bounded a cold cache's compile-ahead (C=1, R=4096: 60 s on the H200's host, 56 s here), see
`reduce.py`'s docstring for before and after.

    python scripts/bench_triton_compile.py [--threads N] [--what all|threads|tree_rows] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "sam": "i32",
       "sak": "i32", "sbn": "i32", "sbk": "i32", "scm": "i32", "scn": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
TILES = [(64, 32, 128), (64, 64, 128), (64, 128, 64), (64, 128, 128), (128, 64, 128), (128, 128, 64), (128, 256, 64),
         (64, 256, 64)]


def compile_one(tile) -> float:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlkernel.backends.triton import gemm

    bm, bn, bk = tile
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_PROGS=132, TMA=False, B_NK=True, IEEE=False, SEGS=1,
                 SPLIT=False, K_FIXED=0, STREAM=False, FIXUP=False, BLOCK_N2=0, SCRATCH=False, SLOTS=0, SLICED=False)
    src = ASTSource(fn=gemm._gemm_kernel, signature={**SIG, **{k: "constexpr" for k in const}}, constexprs=const)
    t = time.perf_counter()
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8 if bm == 128 else 4, "num_stages": 3})
    return time.perf_counter() - t


def tree_rows_classes() -> list[tuple[int, int]]:
    """Every (log2 R, C) `tree_sum_rows` launches: `_shape` reads only the padded length and whether m == 1."""
    from rlkernel.backends.triton import reduce

    return sorted({reduce._shape(1 << b, m) for b in range(1, 25) for m in (1, 2)})


def tree_rows_seconds() -> dict:
    """{"C=c,R=r": compile seconds} for every class, serially into a fresh cache, and their sum."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlkernel.backends.triton import reduce

    each = {}
    with tempfile.TemporaryDirectory(prefix="rlkernel_compile_") as cache:
        knobs.cache.dir = cache
        for log2r, c in tree_rows_classes():
            src = ASTSource(reduce._tree_rows_kernel, reduce.TREE_ROWS_SIGNATURE, constexprs={"C": c, "R": 1 << log2r, "LOG2R": log2r})
            t = time.perf_counter()
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": reduce.NUM_WARPS})
            each[f"C={c},R={1 << log2r}"] = round(time.perf_counter() - t, 3)
    return {"seconds": each, "sum": round(sum(each.values()), 3), "slowest": max(each, key=each.get)}


def timed(threads: int) -> dict:
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="rlkernel_compile_") as cache:
        knobs.cache.dir = cache  # a cold cache for each mode
        t0 = time.perf_counter()
        if threads <= 1:
            each = [compile_one(t) for t in TILES]
        else:
            with ThreadPoolExecutor(threads) as ex:
                each = list(ex.map(compile_one, TILES))
        return {"threads": threads, "wall_seconds": round(time.perf_counter() - t0, 3), "sum_of_compiles": round(sum(each), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--what", choices=("all", "threads", "tree_rows"), default="all",
                    help="the GEMM's serial-against-threads compile, the tree-sum classes' compile seconds, or both")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu_triton_compile_threads.json"))
    args = ap.parse_args()
    try:
        import triton
    except ImportError:
        print(json.dumps({"skipped": "no triton"}))
        return 0
    from triton.compiler import ASTSource  # noqa: F401 -- imports outside the timed part

    from rlkernel.backends.triton import gemm  # noqa: F401

    from vime.stamp import code_stamp

    res = {"triton": triton.__version__, "cpus": os.cpu_count()}
    if args.what in ("all", "threads"):
        serial, parallel = timed(1), timed(args.threads)
        res.update(kernels=len(TILES), serial=serial, parallel=parallel,
                   speedup=round(serial["wall_seconds"] / parallel["wall_seconds"], 2))
    if args.what in ("all", "tree_rows"):
        res["tree_rows"] = tree_rows_seconds()
    res["code"] = code_stamp()
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
