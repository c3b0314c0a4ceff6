#!/usr/bin/env python3
"""An experiment, not a contract: a warp-specialised GEMM tile in Gluon (Triton 3.6's `triton.experimental.gluon`) —
one producer warp issues the TMA loads of A and W into a ring of shared-memory stages, the default warpgroup runs the
wgmma chain (fp32 accumulate, K in order, BK at a time) and the epilogue, with `setmaxnreg` moving registers to it.

Why: sessions 19-25 concluded that Triton 3.6 has no Hopper warp specialisation (`tl.range(warp_specialize=True)` emits
the same sm_90 code) — true of Triton's automatic pass, but Gluon exposes it (`gl.warp_specialize`, with `mbarrier`,
`tma`, `warpgroup_mma`). This is the route FA3 / cuBLAS take to their last 15-30 %, so the attention prefill (0.73x) and
the GEMM at M = 256 may move within our contracts if its wgmma chain gives the production kernels' bits.

    python3 scripts/gpu_gluon_ws.py --compile-only        # any machine: compile for sm_90, report what the PTX holds
    python3 scripts/gpu_gluon_ws.py --out DIR             # an H200: bits vs rlkernel's strict GEMM, time vs cuBLAS

On a GPU, per Qwen3-8B GEMM shape and M: `equal_to_strict` (torch.equal against `gemm.matmul`, the contract's bits),
and the chain timer's ms (a CUDA graph of 8 calls on 8 weights, as scripts/gpu_gemm_sweep.py) for cuBLAS, the strict
GEMM and each Gluon tile. Writes DIR/h200_gluon_ws.json.

Triton 3.6 notes found writing it (CPU compiles): `gl.warp_specialize` cannot return a tensor from the default partition
(`flatten_values_to_ir` is called outside JIT context), so the epilogue runs inside it; block shapes must be powers of
two (a 64 x 192 tile, one wave for qkv at M = 256, needs two accumulators here too).
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

# (BM, BN, BK, STAGES, num_warps of the default partition, OVERLAP: keep one wgmma in flight while the next stage's
# operands are waited for — the stage is released one step later; 0: wait for each wgmma before going on)
TILES = [(128, 128, 64, 4, 4, 0), (128, 128, 64, 4, 4, 1), (64, 128, 64, 6, 4, 1), (128, 256, 64, 3, 8, 1),
         (64, 256, 64, 4, 4, 1)]
PRODUCER_WARPS = gl.constexpr(1)  # the producer partition: one warp, few registers (setmaxnreg gives the rest to the consumer)
PRODUCER_REGS = gl.constexpr(40)


@gluon.jit
def _producer(a_desc, w_desc, bufs_a, bufs_w, ready, empty, off_m, off_n, k_steps, BK: gl.constexpr):
    """One warp: stage i's loads wait until the consumer released stage i - STAGES, then signal `ready`."""
    S: gl.constexpr = bufs_a.type.shape[0]
    for i in range(k_steps):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)  # a fresh barrier counts as released once
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), bufs_a.index(s))
        tma.async_copy_global_to_shared(w_desc, [off_n, i * BK], ready.index(s), bufs_w.index(s))


@gluon.jit
def _consumer(bufs_a, bufs_w, ready, empty, k_steps, c_ptr, M, N, stride_cm, off_m, off_n, BM: gl.constexpr,
              BN: gl.constexpr, OVERLAP: gl.constexpr, layout: gl.constexpr):
    """The default warpgroup(s): acc += A_k @ W_k^T for k in order (one wgmma chain, fp32), then the bf16 store."""
    S: gl.constexpr = bufs_a.type.shape[0]
    acc = gl.zeros((BM, BN), gl.float32, layout)
    for i in range(k_steps):
        s = i % S
        mbarrier.wait(ready.index(s), (i // S) & 1)
        acc = warpgroup_mma(bufs_a.index(s), bufs_w.index(s).permute((1, 0)), acc, is_async=True)
        if OVERLAP:  # step i - 1's wgmma is done: its stage goes back to the producer
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    gl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(gl.bfloat16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@gluon.jit
def ws_gemm_kernel(a_desc, w_desc, c_ptr, M, N, K, stride_cm, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    """C[BM, BN] tile (program ids: M tile, N tile) of A [M, K] @ W [N, K]^T."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])
    bufs_a = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    bufs_w = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    k_steps = gl.cdiv(K, BK)
    gl.warp_specialize([
        (_consumer, (bufs_a, bufs_w, ready, empty, k_steps, c_ptr, M, N, stride_cm, off_m, off_n, BM, BN, OVERLAP, layout)),
        (_producer, (a_desc, w_desc, bufs_a, bufs_w, ready, empty, off_m, off_n, k_steps, BK)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def _layouts(BM, BN, BK):
    return (gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))


def compile_sm90(BM, BN, BK, STAGES, warps, OVERLAP):
    """Compile the kernel for sm_90 here (no GPU needed; Triton ships ptxas): the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    la, lw = _layouts(BM, BN, BK)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{la!r}>", "w_desc": f"tensordesc<bf16[{BN}, {BK}],{lw!r}>",
           "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
           **{k: "constexpr" for k in ("BM", "BN", "BK", "STAGES", "OVERLAP", "num_warps")}}
    src = GluonASTSource(ws_gemm_kernel, sig, constexprs={"BM": BM, "BN": BN, "BK": BK, "STAGES": STAGES, "OVERLAP": OVERLAP,
                                                          "num_warps": warps})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def ptx_facts(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {"setmaxnreg": "setmaxnreg" in ptx, "wgmma": ptx.count("wgmma.mma_async"),
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "warps": kernel.metadata.num_warps,
            "shared_bytes": kernel.metadata.shared}


def ws_gemm(a, w, tile):
    """a [M, K] bf16 @ w [N, K]^T -> [M, N] bf16 on the GPU."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    BM, BN, BK, STAGES, warps, OVERLAP = tile
    M, K = a.shape
    N = w.shape[0]
    la, lw = _layouts(BM, BN, BK)
    c = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [BM, BK], la)
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [BN, BK], lw)
    ws_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](a_desc, w_desc, c, M, N, K, c.stride(0), BM, BN, BK, STAGES,
                                                              OVERLAP, num_warps=warps)
    return c


def tile_name(t) -> str:
    return f"{t[0]}x{t[1]}x{t[2]}_s{t[3]}_w{t[4]}" + ("_overlap" if t[5] else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="256,4096")
    args = ap.parse_args(argv)
    res = {"triton": triton.__version__, "compiled_sm90": {}}
    for t in TILES:
        try:
            res["compiled_sm90"][tile_name(t)] = ptx_facts(compile_sm90(*t))
        except Exception as e:  # noqa: BLE001 -- a tile this Triton cannot build is recorded
            res["compiled_sm90"][tile_name(t)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps(res["compiled_sm90"]), flush=True)
    if args.compile_only:
        return 0
    import torch
    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
    else:
        from gpu_gemm_sweep import chain_ms
        from gpu_strict_parity import GEMMS
        from rlkernel.backends.triton import gemm

        res["device"] = torch.cuda.get_device_name()
        res["rows"] = []
        t0 = time.time()
        for name in ("qkv", "o", "gate_up", "down"):
            K, N = GEMMS[name]
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(8)]
            for M in (int(m) for m in args.ms.split(",")):
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                strict = gemm.matmul(a, ws[0])
                row = {"gemm": name, "M": M, "K": K, "N": N,
                       "cublas_ms": round(chain_ms(lambda i: torch.nn.functional.linear(a, ws[i])), 4),
                       "strict_ms": round(chain_ms(lambda i: gemm.matmul(a, ws[i])), 4), "tiles": {}}
                for t in TILES:
                    try:
                        y = ws_gemm(a, ws[0], t)
                        rec = {"equal_to_strict": bool(torch.equal(y, strict)),
                               "max_abs_vs_strict": float((y.float() - strict.float()).abs().max()),
                               "ms": round(chain_ms(lambda i, t=t: ws_gemm(a, ws[i], t)), 4)}
                        rec["vs_cublas"] = round(row["cublas_ms"] / rec["ms"], 3)
                    except Exception as e:  # noqa: BLE001
                        rec = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    row["tiles"][tile_name(t)] = rec
                row["strict_vs_cublas"] = round(row["cublas_ms"] / row["strict_ms"], 3)
                res["rows"].append(row)
                print(f"[{time.time() - t0:6.1f}s]", json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_gluon_ws.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
