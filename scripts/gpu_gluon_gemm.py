#!/usr/bin/env python3
"""An experiment, not a contract (session 28): two GEMM tiles in Gluon that the Triton kernel cannot express, each
checked bit for bit against rlkernel's strict GEMM and timed against it and cuBLAS at the Qwen3-8B shapes.

1. **Wave-balanced tiles for the column-parallel GEMMs at small M** (qkv 0.67-0.73x cuBLAS at M = 256): session 28's
   `gpu_cublas_probe.py` found cuBLAS's kernel there is `nvjet_sm90_tst_96x128_64x7_2x1` (and `192x128` for gate_up at
   M = 256, qkv at 1,024): tiles of 96 / 192 columns, so N = 6,144 makes 2 x 64 = 128 work items on 132 SMs (the
   strict table's 128 x 128: 96, a 0.73 wave), no split of K. Gluon (like Triton) refuses block shapes that are not
   powers of two, so a 96-column tile here is two accumulators, 64 + 32 columns (192: 128 + 64), each a wgmma chain over
   the same A stage; AREG=1 loads A into registers once per step and both chains read it there (session 19's Triton
   two-accumulator tile lost, 0.34-0.52x, with A read from shared memory twice).
2. **The row-parallel GEMM's canonical K segments in a warp-specialised consumer** (o / down with 4 segments:
   production's scratch / registers / fixup schedules 0.56-0.79x cuBLAS at M >= 256): the producer warp streams every
   K step's loads without a break, the consumer runs each segment's wgmma chain from zero and folds it into the tree
   ((s0 + s1) + (s2 + s3)) in registers as it ends (the statically unrolled segment loop: no pipeline restarts).

Every tile's K order is the contract's (fp32 accumulate, BK = 64 steps in order, wgmma k16 in order inside a step), so
the bits should equal `gemm.matmul` (segments: `gemm.matmul(..., k_segments=4)`): `equal_to_strict` (torch.equal) says.

    python3 scripts/gpu_gluon_gemm.py --compile-only    # any machine: compile every tile for sm_90; ptxas registers / spills
    python3 scripts/gpu_gluon_gemm.py --out DIR         # an H200: bits and chain times; writes DIR/h200_gluon_gemm.json
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
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait  # noqa: E402

PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGS = gl.constexpr(40)
BK = 64


@gluon.jit
def _producer(a_desc, w1_desc, w2_desc, bufs_a, bufs_w1, bufs_w2, ready, empty, off_m, off_n, k_steps,
              BK: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr):
    """One warp: step i's A and W boxes (W as BN1 rows, then BN2 more) into stage i % S once the consumer freed it."""
    S: gl.constexpr = bufs_a.type.shape[0]
    for i in range(k_steps):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
        if BN2 > 0:
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w1_desc.block_type.nbytes +
                            w2_desc.block_type.nbytes)
        else:
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w1_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), bufs_a.index(s))
        tma.async_copy_global_to_shared(w1_desc, [off_n, i * BK], ready.index(s), bufs_w1.index(s))
        if BN2 > 0:
            tma.async_copy_global_to_shared(w2_desc, [off_n + BN1, i * BK], ready.index(s), bufs_w2.index(s))


@gluon.jit
def _store(c_ptr, acc, off_m, col0, M, N, stride_cm, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    gl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(gl.bfloat16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@gluon.jit
def _consumer(bufs_a, bufs_w1, bufs_w2, ready, empty, k_steps, c_ptr, M, N, stride_cm, off_m, off_n,
              BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, SEGS: gl.constexpr, AREG: gl.constexpr,
              l1: gl.constexpr, l2: gl.constexpr):
    """acc (+ acc2) += A_k @ W_k^T, one wgmma chain per accumulator, K in order; SEGS > 1: each of SEGS equal K
    segments from zero, folded into the balanced tree as it ends (ksegments._k_stream's order)."""
    S: gl.constexpr = bufs_a.type.shape[0]
    seg_steps = k_steps // SEGS
    acc = gl.zeros((BM, BN1), gl.float32, l1)
    lo = gl.zeros((BM, BN1), gl.float32, l1)
    hi = gl.zeros((BM, BN1), gl.float32, l1)
    acc2 = gl.zeros((BM, BN2 if BN2 > 0 else 8), gl.float32, l2)
    for sg in gl.static_range(SEGS):
        acc = gl.zeros((BM, BN1), gl.float32, l1)
        for j in range(seg_steps):
            i = sg * seg_steps + j
            s = i % S
            mbarrier.wait(ready.index(s), (i // S) & 1)
            if AREG:
                a = bufs_a.index(s).load(gl.DotOperandLayout(operand_index=0, parent=l1, k_width=2))
            else:
                a = bufs_a.index(s)
            acc = warpgroup_mma(a, bufs_w1.index(s).permute((1, 0)), acc, is_async=True)
            if BN2 > 0:
                if AREG:
                    a2 = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=l2, k_width=2))
                    acc2 = warpgroup_mma(a2, bufs_w2.index(s).permute((1, 0)), acc2, is_async=True)
                    acc, acc2, a, a2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2, a, a2))
                else:
                    acc2 = warpgroup_mma(a, bufs_w2.index(s).permute((1, 0)), acc2, is_async=True)
                    acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
            else:
                if AREG:
                    acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
        if SEGS > 1:  # segment sg ended: its partial joins the tree (s0; s0 + s1; s2; (s0 + s1) + (s2 + s3))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if sg == 0:
                lo = acc
            elif sg == 1:
                lo = lo + acc
            elif sg == 2:
                hi = acc
            else:
                lo = lo + (hi + acc)
    if SEGS > 1:
        _store(c_ptr, lo, off_m, off_n, M, N, stride_cm, BM, BN1, l1)
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _store(c_ptr, acc, off_m, off_n, M, N, stride_cm, BM, BN1, l1)
        if BN2 > 0:
            acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2,))
            _store(c_ptr, acc2, off_m, off_n + BN1, M, N, stride_cm, BM, BN2, l2)


@gluon.jit
def gemm_kernel(a_desc, w1_desc, w2_desc, c_ptr, M, N, K, stride_cm, BM: gl.constexpr, BN1: gl.constexpr,
                BN2: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, SEGS: gl.constexpr, AREG: gl.constexpr,
                num_warps: gl.constexpr):
    """C[BM, BN1 + BN2] tile (program ids: M tile, N tile) of A [M, K] @ W [N, K]^T."""
    l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN1, 16])
    l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, BN2 if BN2 > 0 else 8, 16])
    bufs_a = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    bufs_w1 = gl.allocate_shared_memory(w1_desc.dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
    if BN2 > 0:
        bufs_w2 = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
    else:
        bufs_w2 = bufs_w1
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * (BN1 + BN2)
    k_steps = gl.cdiv(K, BK)
    gl.warp_specialize([
        (_consumer, (bufs_a, bufs_w1, bufs_w2, ready, empty, k_steps, c_ptr, M, N, stride_cm, off_m, off_n, BM, BN1,
                     BN2, SEGS, AREG, l1, l2)),
        (_producer, (a_desc, w1_desc, w2_desc, bufs_a, bufs_w1, bufs_w2, ready, empty, off_m, off_n, k_steps, BK, BN1,
                     BN2)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


# name -> (BM, BN1, BN2, STAGES, SEGS, AREG, num_warps of the default partition)
TILES = {
    "128x96_s5": (128, 64, 32, 5, 1, 0, 8),
    "128x96_areg_s5": (128, 64, 32, 5, 1, 1, 8),
    "64x96_areg_s6": (64, 64, 32, 6, 1, 1, 4),
    "128x192_s4": (128, 128, 64, 4, 1, 0, 8),
    "128x192_areg_s4": (128, 128, 64, 4, 1, 1, 8),
    "128x128_s4": (128, 128, 0, 4, 1, 0, 8),  # the plain tile, for reference
    "64x128_s6": (64, 128, 0, 6, 1, 0, 4),
    "seg4_64x128_s6": (64, 128, 0, 6, 4, 0, 4),
    "seg4_128x128_s4": (128, 128, 0, 4, 4, 0, 8),
    "seg4_128x64_s6": (128, 64, 0, 6, 4, 0, 8),
}  # (a 64 x 256 segmented tile spills on sm_90: 3 live accumulators of 128 registers a thread)
# which tiles each shape tries (segments: the row-parallel layers)
PLAN = {"qkv": ["128x96_s5", "128x96_areg_s5", "64x96_areg_s6", "128x192_s4", "128x128_s4"],
        "gate_up": ["128x192_s4", "128x192_areg_s4", "128x96_s5", "128x96_areg_s5", "128x128_s4"],
        "o": ["seg4_64x128_s6", "seg4_128x128_s4", "seg4_128x64_s6", "64x128_s6"],
        "down": ["seg4_64x128_s6", "seg4_128x128_s4", "seg4_128x64_s6", "64x128_s6"]}


def _layout(rows):
    return gl.NVMMASharedLayout.get_default_for([rows, BK], gl.bfloat16)


def compile_sm90(name):
    """Compile a tile for sm_90 here (no GPU needed): the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    BM, BN1, BN2, STAGES, SEGS, AREG, warps = TILES[name]
    n2 = BN2 or BN1
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{_layout(BM)!r}>",
           "w1_desc": f"tensordesc<bf16[{BN1}, {BK}],{_layout(BN1)!r}>",
           "w2_desc": f"tensordesc<bf16[{n2}, {BK}],{_layout(n2)!r}>",
           "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
           **{k: "constexpr" for k in ("BM", "BN1", "BN2", "BK", "STAGES", "SEGS", "AREG", "num_warps")}}
    const = {"BM": BM, "BN1": BN1, "BN2": BN2, "BK": BK, "STAGES": STAGES, "SEGS": SEGS, "AREG": AREG, "num_warps": warps}
    src = GluonASTSource(gemm_kernel, sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def facts(kernel) -> dict:
    import re

    from gpu_gluon_attn import ptxas_usage

    ptx = kernel.asm["ptx"]
    return {"wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": "setmaxnreg" in ptx,
            "shared_bytes": kernel.metadata.shared, "ptxas": ptxas_usage(ptx)}


def run(a, w, name):
    """a [M, K] bf16 @ w [N, K]^T -> [M, N] bf16 on the GPU through tile `name`."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    BM, BN1, BN2, STAGES, SEGS, AREG, warps = TILES[name]
    M, K = a.shape
    N = w.shape[0]
    if N % (BN1 + BN2) or K % (BK * SEGS):
        raise ValueError(f"{name}: N={N} / K={K} do not divide into its tile")
    n2 = BN2 or BN1
    c = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [BM, BK], _layout(BM))
    w1 = TensorDescriptor(w, list(w.shape), list(w.stride()), [BN1, BK], _layout(BN1))
    w2 = TensorDescriptor(w, list(w.shape), list(w.stride()), [n2, BK], _layout(n2))
    gemm_kernel[(triton.cdiv(M, BM), N // (BN1 + BN2))](a_desc, w1, w2, c, M, N, K, c.stride(0), BM, BN1, BN2, BK, STAGES,
                                                        SEGS, AREG, num_warps=warps)
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="256,512,1024,4096")
    args = ap.parse_args(argv)
    res = {"triton": triton.__version__, "compiled_sm90": {}}
    for name in TILES:
        try:
            res["compiled_sm90"][name] = facts(compile_sm90(name))
        except Exception as e:  # noqa: BLE001 -- a tile this Triton cannot build is recorded
            res["compiled_sm90"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(name, json.dumps(res["compiled_sm90"][name]), flush=True)
    if not args.compile_only:
        import torch
        if not torch.cuda.is_available():
            res["skipped"] = "no CUDA device"
        else:
            from gpu_gemm_sweep import chain_ms
            from gpu_strict_parity import GEMMS
            from rlkernel.backends.triton import gemm, gemm_gluon, ops

            res["device"] = torch.cuda.get_device_name()
            res["timer"] = "chain: a CUDA graph of 8 calls on 8 weights, ms per call (scripts/gpu_gemm_sweep.chain_ms)"
            res["rows"] = []
            t0 = time.time()
            for gname, tiles in PLAN.items():
                K, N = GEMMS[gname]
                segs = 4 if gname in ("o", "down") else 1
                ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(8)]
                for M in (int(m) for m in args.ms.split(",")):
                    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                    sched = "scratch" if segs > 1 else None  # the Triton kernel's schedule before session 28
                    lib_sched = ops.segment_schedule(M, N, K, segs) if segs > 1 else None

                    def strict(i, a=a, sched=sched, segs=segs):
                        return gemm.matmul(a, ws[i], k_segments=segs, schedule=sched)

                    def library(i, a=a, segs=segs, lib_sched=lib_sched):
                        return gemm.matmul(a, ws[i], k_segments=segs, schedule=lib_sched)

                    gemm_gluon._ENABLED = False  # the Triton kernel: the reference bits and the old time
                    try:
                        ref = strict(0)
                        row = {"gemm": gname, "M": M, "K": K, "N": N, "k_segments": segs, "strict_schedule": sched,
                               "cublas_ms": round(chain_ms(lambda i: torch.nn.functional.linear(a, ws[i])), 4),
                               "strict_ms": round(chain_ms(strict), 4), "tiles": {}}
                        if segs > 1:  # the unsegmented strict GEMM: what the segments cost
                            row["strict_plain_ms"] = round(chain_ms(lambda i: gemm.matmul(a, ws[i])), 4)
                    finally:
                        gemm_gluon._ENABLED = True
                    # the library as shipped: gemm.matmul with ops.segment_schedule's pick (a Gluon tile where
                    # gemm_gluon.pick names one, after its first-use check)
                    tile = gemm_gluon.choose(a, ws[0], segs, None, None)
                    y = library(0)
                    row["library"] = {"schedule": lib_sched, "gluon_tile": tile and tile.name,
                                      "equal_to_strict": bool(torch.equal(y, ref)), "ms": round(chain_ms(library), 4)}
                    row["library"]["vs_cublas"] = round(row["cublas_ms"] / row["library"]["ms"], 3)
                    row["library"]["vs_strict"] = round(row["strict_ms"] / row["library"]["ms"], 3)
                    for name in tiles:
                        try:
                            y = run(a, ws[0], name)
                            rec = {"equal_to_strict": bool(torch.equal(y, ref)),
                                   "rows_differ": int((y != ref).any(dim=1).sum()),
                                   "run_to_run_equal": bool(torch.equal(y, run(a, ws[0], name))),
                                   "ms": round(chain_ms(lambda i, name=name: run(a, ws[i], name)), 4)}
                            rec["vs_cublas"] = round(row["cublas_ms"] / rec["ms"], 3)
                            rec["vs_strict"] = round(row["strict_ms"] / rec["ms"], 3)
                        except Exception as e:  # noqa: BLE001
                            rec = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                        row["tiles"][name] = rec
                    row["strict_vs_cublas"] = round(row["cublas_ms"] / row["strict_ms"], 3)
                    res["rows"].append(row)
                    print(f"[{time.time() - t0:6.1f}s]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from rlkernel.backends.triton import gemm_gluon
        res["gemm_gluon"] = gemm_gluon.describe()  # the first-use checks' outcomes
    except Exception as e:  # noqa: BLE001
        res["gemm_gluon"] = f"{type(e).__name__}: {e}"
    (out / "h200_gluon_gemm.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"tiles": len(res["compiled_sm90"]), "rows": len(res.get("rows", [])),
                      "errors": [k for k, v in res["compiled_sm90"].items() if "error" in v]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
