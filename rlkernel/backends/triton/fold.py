"""The running sum of tile products in one launch: the vocab-parallel logprob backward's dL/dhidden.

The linear-logprob contract defines dL/dhidden of a vocab segment as a left fold over its vocab tiles
in order, acc = (((acc + dz_0 W_0) + dz_1 W_1) + ...), each dz_t W_t a float32 GEMM-contract product
of its own (a [T, tile] x [tile, H] matmul from zero). The composition (`parallel.vocab_parallel`)
runs a GEMM and an add per tile: 297 tiles of 512 rows for a 151,936-token vocabulary, about 900
launches an update. This kernel computes the same fold per output block: for each tile in order a
fresh float32 accumulator walks the tile's K range exactly as the plain GEMM kernel does
(`tile._k_span`: K blocks in order from zero, IEEE float32 dot, the same masks relative to the
tile's end), then one IEEE add into the running sum, compiled without contraction
(`enable_fp_fusion=False`). The IEEE float32 dot is a chain of fused multiply-adds over K in order,
so each tile's product has the plain GEMM's bits whatever the block shape, and so has the sum
(tests under TRITON_INTERPRET=1 and `scripts/gpu_strict_parity.py --only reduce` compare it with
the per-tile composition, torch.equal).

Operands in bf16 or fp16 (both the same dtype: the vocab-parallel backward of a bf16 model rounds dz to the lm_head's
dtype) run `_fold_lowp_kernel`: each tile's product is the plain GEMM kernel's own K walk (`tile._k_span`: tensor
cores, float32 accumulate, K blocks in order from the tile's start) with the K block the GEMM contract gives that
product alone (`contracts.gpu.gemm_config` for its N, K = tile, M; its columns halved while the two live
accumulators would not fit the registers), so it has the bits of `gemm.matmul(a_t, b=b_t, out_dtype=float32)` (a
wgmma chain's bits do not depend on the tile: every GEMM config measured on the H200), and the running sum is the
same IEEE add.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contracts as C
from .tile import _k_span
from .launch import fast, cdiv


@triton.jit(do_not_specialize=["M"])  # M, the scored tokens, changes every step: one compiled variant, not three
def _fold_kernel(a_ptr, b_ptr, c_ptr, out_ptr, M, N, K, TILE, sam, sak, sbk, sbn, scm, som,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmc = tl.where(rm < M, rm, 0).to(tl.int64)
    rnc = tl.where(rn < N, rn, 0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.load(c_ptr + rmc[:, None] * scm + rnc[None, :])
    for t0 in range(0, K, TILE):
        t1 = tl.minimum(t0 + TILE, K)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(t0, t1, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + rmc[:, None] * sam + kk[None, :] * sak, mask=kk[None, :] < t1, other=0.0)
            b = tl.load(b_ptr + kk[:, None] * sbk + rnc[None, :] * sbn, mask=kk[:, None] < t1, other=0.0).to(tl.float32)
            part = tl.dot(a, b, part, input_precision="ieee")
        acc = acc + part
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * som + rn[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fold_lowp_kernel(a_ptr, b_ptr, c_ptr, out_ptr, M, N, K, TILE, sam, sak, sbk, sbn, scm, som,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rmc = tl.where(rm < M, rm, 0).to(tl.int64)
    rnc = tl.where(rn < N, rn, 0).to(tl.int64)
    acc = tl.load(c_ptr + rmc[:, None] * scm + rnc[None, :])
    for t0 in range(0, K, TILE):
        t1 = tl.minimum(t0 + TILE, K)
        acc = acc + _k_span(a_ptr, b_ptr, off_m, off_n, M, N, t0, t1, sam, sak, sbn, sbk,
                            BLOCK_M, BLOCK_N, BLOCK_K, False, False, False)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * som + rn[None, :], acc, mask=mask)


def fold_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tile: int) -> torch.Tensor:
    """acc [M, N] float32 plus a [M, K] float32 @ b [K, N] (any float dtype, widened exactly) as the left fold over
    K tiles of `tile` in order, each tile's product from zero: ((acc + a_0 b_0) + a_1 b_1) + ... -> a new [M, N]."""
    if a.dim() != 2 or b.dim() != 2 or acc.dim() != 2 or a.shape[1] != b.shape[0] or acc.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"fold_matmul: acc {tuple(acc.shape)} + a {tuple(a.shape)} @ b {tuple(b.shape)} do not match")
    lowp = a.dtype in (torch.bfloat16, torch.float16)
    if acc.dtype != torch.float32 or not (a.dtype == torch.float32 or (lowp and b.dtype == a.dtype)):
        raise ValueError(f"fold_matmul: acc must be float32 and a float32 (b any float dtype) or a and b both bf16 / "
                         f"fp16, got acc {acc.dtype}, a {a.dtype}, b {b.dtype}")
    if tile < 1:
        raise ValueError(f"fold_matmul: tile must be >= 1, got {tile}")
    M, K = a.shape
    N = b.shape[1]
    acc = acc if acc.stride(-1) == 1 else acc.contiguous()
    out = torch.empty((M, N), dtype=torch.float32, device=a.device)
    if M == 0 or N == 0:
        return out
    if lowp:  # each tile's product by the plain GEMM's K walk on the GEMM contract's blocks for it; the running sum and
        # the tile's product are two live accumulators, so the tile's columns are halved until both fit the registers
        # (128x256 -> 128x128 from M > 1024): scheduling only, a wgmma chain's bits do not depend on the tile
        cfg = C._fit_accumulators(C.gemm_config(C.dtype_name(a.dtype), N, tile, M), 2)
        grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
        _fold_lowp_kernel_fast[grid](a, b, acc, out, M, N, K, tile, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                acc.stride(0), out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                enable_fp_fusion=False)
        return out
    cfg = C.FP32_GEMM  # the float32 GEMM's blocks: its dot per block (the same under the interpreter's numpy dot too)
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
    _fold_kernel_fast[grid](a, b, acc, out, M, N, K, tile, a.stride(0), a.stride(1), b.stride(0), b.stride(1), acc.stride(0),
                       out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       num_warps=cfg.num_warps, enable_fp_fusion=False)
    return out

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_fold_lowp_kernel_fast = fast(_fold_lowp_kernel)
_fold_kernel_fast = fast(_fold_kernel)
