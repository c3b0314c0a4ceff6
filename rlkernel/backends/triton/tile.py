"""One output tile's K walk for the strict GEMM's kernels (gemm.py, and logprob.py / fold.py that reuse it): the tile
walk, the dot, K blocks in order from zero into one fp32 accumulator (or two, _k_loop2). Device code only."""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % size_m
    pid_n = (tile % group) // size_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _k_span(a_src, b_src, off_m, off_n, M, N, k_lo, k_hi, sam, sak, sbn, sbk,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr):
    """fp32 accumulator of one [BLOCK_M, BLOCK_N] tile over K in [k_lo, k_hi): blocks in order from
    zero. With TMA, k_hi - k_lo is a multiple of BLOCK_K or k_hi is the end of K (zero-filled tail)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(k_hi - k_lo, BLOCK_K)
    if TMA:
        for ki in range(k_tiles):
            a = a_src.load([off_m, k_lo + ki * BLOCK_K])
            if B_NK:
                b = b_src.load([off_n, k_lo + ki * BLOCK_K]).T
            else:
                b = b_src.load([k_lo + ki * BLOCK_K, off_n])
            acc = _dot(a, b, acc, IEEE)
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rm = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
        rn = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BLOCK_N), BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        for ki in range(k_tiles):
            kk = k_lo + ki * BLOCK_K + rk
            a = tl.load(a_src + rm[:, None].to(tl.int64) * sam + kk[None, :] * sak, mask=kk[None, :] < k_hi, other=0.0)
            b = tl.load(b_src + kk[:, None] * sbk + rn[None, :].to(tl.int64) * sbn, mask=kk[:, None] < k_hi, other=0.0)
            acc = _dot(a, b, acc, IEEE)
    return acc


@triton.jit
def _k_loop(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr):
    """fp32 accumulator of one [BLOCK_M, BLOCK_N] tile: K blocks 0, 1, 2, ... in order."""
    return _k_span(a_src, b_src, off_m, off_n, M, N, 0, K, sam, sak, sbn, sbk, BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_NK, IEEE)


@triton.jit
def _k_loop2(a_src, b_src, b2_src, off_m, off_n, off_n2, M, N, N2, K, sam, sak, sbn, sbk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr,
             TMA: tl.constexpr, B_NK: tl.constexpr, IEEE: tl.constexpr):
    """_k_loop for two accumulators fed by each loaded A block: [BLOCK_M, BLOCK_N] at columns off_n (below N) and
    [BLOCK_M, BLOCK_N2] at columns off_n2 (below N2; b2_src's). A tile of BLOCK_N + BLOCK_N2 columns (off_n2 = off_n +
    BLOCK_N, N2 = N: a width that is no power of two, 96 or 192, so that a wave of SMs divides the tiles), or the
    SwiGLU epilogue's gate and up tiles (off_n2 = N + off_n of a [2N, K] weight). Each output element's chain is the
    same K blocks in the same order as in a one-accumulator tile: the contract's bits (scheduling only)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if TMA:
        for ki in range(k_tiles):
            a = a_src.load([off_m, ki * BLOCK_K])
            if B_NK:
                b = b_src.load([off_n, ki * BLOCK_K]).T
                b2 = b2_src.load([off_n2, ki * BLOCK_K]).T
            else:
                b = b_src.load([ki * BLOCK_K, off_n])
                b2 = b2_src.load([ki * BLOCK_K, off_n2])
            acc = _dot(a, b, acc, IEEE)
            acc2 = _dot(a, b2, acc2, IEEE)
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rn2 = off_n2 + tl.arange(0, BLOCK_N2)
        rm = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
        rn = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BLOCK_N), BLOCK_N)
        rn2 = tl.max_contiguous(tl.multiple_of(tl.where(rn2 < N2, rn2, 0), BLOCK_N2), BLOCK_N2)
        rk = tl.arange(0, BLOCK_K)
        for ki in range(k_tiles):
            kk = ki * BLOCK_K + rk
            a = tl.load(a_src + rm[:, None].to(tl.int64) * sam + kk[None, :] * sak, mask=kk[None, :] < K, other=0.0)
            b = tl.load(b_src + kk[:, None] * sbk + rn[None, :].to(tl.int64) * sbn, mask=kk[:, None] < K, other=0.0)
            b2 = tl.load(b_src + kk[:, None] * sbk + rn2[None, :].to(tl.int64) * sbn, mask=kk[:, None] < K, other=0.0)
            acc = _dot(a, b, acc, IEEE)
            acc2 = _dot(a, b2, acc2, IEEE)
    return acc, acc2
