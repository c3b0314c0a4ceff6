"""Backward of packed varlen causal GQA attention (attention.attention_varlen), for training.

FlashAttention-2 shape, recomputing P = exp2(s * scale * log2 e - lse * log2 e) from q, k and
the forward's natural-log lse, in three kernels:

* delta = rowsum(dO * O) in fp32, one value per (token, q head);
* dK, dV: one program per (block_n keys of one sequence, kv head); it walks that sequence's
  q blocks in ascending order and, inside each, the G query heads of its group in ascending
  order, accumulating dK and dV for its keys in fp32 registers;
* dQ: one program per q tile of the forward's shape (dq_block_m // G tokens x the G heads of
  one kv head), walking key chunks 0, 1, ... up to its causal edge.

What this fixes, and why:

* no atomics and no split-K: every gradient element is written by exactly one program, whose
  summation order is a fixed walk, so run to run the bits are equal by construction;
* every tile (q blocks, key blocks, key chunks, delta tiles) is anchored at its own
  sequence's first token and masked at its last, so a program never sees another sequence
  and a sequence's gradients are the same bits alone or packed with any others;
* the block sizes come from bwd_config(D, G, dtype) and nothing else (never T, B or the
  lengths); the launch grid grows with max_seqlen, but an empty program stores nothing;
* fp contraction is off (the FMAs are explicit); dots are IEEE fp32 for fp32 inputs and
  tensor core (fp32 accumulate) for bf16/fp16, with P and dS rounded to the input dtype as
  the dots' left operand; dQ and dK take the softmax scale once, at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tile import _dot
from .launch import fast, cdiv

_LOG2E = 1.4426950408889634


@dataclass(frozen=True, kw_only=True)
class AttentionBwdConfig:
    block_m: int = 32  # dK/dV kernel: query tokens per step (one query head at a time)
    block_n: int = 64  # dK/dV kernel: keys per program (their dK, dV live in fp32 registers)
    dq_block_m: int = 128  # dQ and delta kernels: rows = (dq_block_m // G) tokens x G heads of one kv head
    dq_block_n: int = 32  # dQ kernel: keys per step
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n", "dq_block_m", "dq_block_n", "num_warps"):
            x = getattr(self, name)
            if x < 1 or x & (x - 1):
                raise ValueError(f"AttentionBwdConfig.{name}={x} must be a power of two")
        if self.num_stages < 1:
            raise ValueError("AttentionBwdConfig.num_stages must be >= 1")


def bwd_config(head_dim: int, group: int, dtype_name: str) -> AttentionBwdConfig:
    """The tiles for (D, G, dtype), never the token count. Not yet timed: chosen as the largest tiles
    that ptxas (sm_90a, Triton 3.9 codegen) fits in registers without spilling; sweep them on the H200."""
    if dtype_name in ("float32", "torch.float32"):  # IEEE dots on the FMA units: a checking path
        return AttentionBwdConfig(block_m=16, block_n=32, dq_block_m=max(32, group), dq_block_n=32,
                                  num_warps=8, num_stages=1)
    if head_dim <= 64:
        return AttentionBwdConfig(block_m=32, block_n=128, dq_block_m=max(128, group), dq_block_n=64,
                                  num_warps=8, num_stages=2)
    if head_dim <= 128:  # block_n=128 halves the q/dO re-reads but spilled (672 B/thread) there
        return AttentionBwdConfig(block_m=32, block_n=64, dq_block_m=max(128, group), dq_block_n=32,
                                  num_warps=8, num_stages=2)
    return AttentionBwdConfig(block_m=16, block_n=64, dq_block_m=max(64, group), dq_block_n=32,
                              num_warps=8, num_stages=1)


@triton.jit
def _q_tile(qs_ptr, ql_ptr, req, tile, kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of a forward-shaped q tile: (BLOCK_M // G) tokens of sequence `req` x its G heads."""
    TOK: tl.constexpr = BLOCK_M // G
    q_len = tl.load(ql_ptr + req)
    q_start = tl.load(qs_ptr + req)
    tok0 = tile * TOK
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // G
    head = kvh * G + r % G
    row = (q_start + tok).to(tl.int64)
    # BLOCK_M % G padding rows (a group that does not divide the tile) would hold the next tile's first token: masked
    return q_len, q_start, tok0, tok, head, row, (tok < q_len) & (r < TOK * G)


@triton.jit(do_not_specialize=["n_tiles"])
def _bwd_delta(o_ptr, do_ptr, delta_ptr, qs_ptr, ql_ptr, sot, soh, sdot, sdoh, n_tiles,
               G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
    kvh = tl.program_id(2)
    q_len, q_start, tok0, tok, head, row, row_ok = _q_tile(qs_ptr, ql_ptr, tl.program_id(1), tl.program_id(0),
                                                           kvh, G, BLOCK_M)
    if tok0 < q_len:
        d = tl.arange(0, D)
        o = tl.load(o_ptr + row[:, None] * sot + head[:, None] * soh + d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + row[:, None] * sdot + head[:, None] * sdoh + d[None, :], mask=row_ok[:, None],
                     other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + row * (tl.num_programs(2) * G) + head, delta, mask=row_ok)


@triton.jit
def _dq_chunk(dq, q, do, lse2, delta, tok, k_ptr, v_ptr, q_start, q_len, kvh, c, skt, skh, svt, svh, qk_scale,
              MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
              IEEE: tl.constexpr):
    kpos = c * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_ok = kpos < q_len
    krow = (q_start + kpos).to(tl.int64)
    d = tl.arange(0, D)
    k = tl.load(k_ptr + krow[:, None] * skt + kvh * skh + d[None, :], mask=kv_ok[:, None], other=0.0)
    v = tl.load(v_ptr + krow[:, None] * svt + kvh * svh + d[None, :], mask=kv_ok[:, None], other=0.0)
    s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
    p = tl.exp2(tl.fma(s, qk_scale, -lse2[:, None]))
    if MASK:
        p = tl.where(kpos[None, :] <= tok[:, None], p, 0.0)
    dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
    ds = p * (dp - delta[:, None])
    return _dot(ds.to(k.dtype), k, dq, IEEE)


@triton.jit(do_not_specialize=["n_tiles"])
def _bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, qs_ptr, ql_ptr,
            sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdqt, sdqh, scale, qk_scale, n_tiles,
            G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    kvh = tl.program_id(2)
    tile = n_tiles - 1 - tl.program_id(0)  # the longest walks start first
    q_len, q_start, tok0, tok, head, row, row_ok = _q_tile(qs_ptr, ql_ptr, tl.program_id(1), tile, kvh, G, BLOCK_M)
    if tok0 < q_len:
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + row[:, None] * sdot + head[:, None] * sdoh + d[None, :], mask=row_ok[:, None],
                     other=0.0)
        lidx = row * (tl.num_programs(2) * G) + head
        # a padding row gets lse = +inf, so its p is exactly 0 without a mask
        lse2 = tl.load(lse_ptr + lidx, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_ptr + lidx, mask=row_ok, other=0.0)
        dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        n_full = (tok0 + 1) // BLOCK_N  # chunks every row of the tile sees whole
        n_chunks = (tl.minimum(tok0 + BLOCK_M // G, q_len) - 1) // BLOCK_N + 1
        for c in range(0, n_full):
            dq = _dq_chunk(dq, q, do, lse2, delta, tok, k_ptr, v_ptr, q_start, q_len, kvh, c, skt, skh, svt, svh,
                           qk_scale, False, BLOCK_M, BLOCK_N, D, IEEE)
        for c in range(n_full, n_chunks):  # the causal edge
            dq = _dq_chunk(dq, q, do, lse2, delta, tok, k_ptr, v_ptr, q_start, q_len, kvh, c, skt, skh, svt, svh,
                           qk_scale, True, BLOCK_M, BLOCK_N, D, IEEE)
        dq = dq * scale
        tl.store(dq_ptr + row[:, None] * sdqt + head[:, None] * sdqh + d[None, :], dq.to(dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _dkdv_step(dk, dv, k, v, kpos, q_ptr, do_ptr, lse_ptr, delta_ptr, q_start, q_len, i, h, hq,
               sqt, sqh, sdot, sdoh, qk_scale, MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, IEEE: tl.constexpr):
    tok = i * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tok < q_len
    row = (q_start + tok).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None] * sqt + h * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + row[:, None] * sdot + h * sdoh + d[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(lse_ptr + row * hq + h, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + row * hq + h, mask=row_ok, other=0.0)
    # transposed scores [keys, tokens]: dK and dV are then plain left-hand dots, no transposed outputs
    st = _dot(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
    pt = tl.exp2(tl.fma(st, qk_scale, -lse2[None, :]))
    if MASK:
        pt = tl.where(kpos[:, None] <= tok[None, :], pt, 0.0)
    dv = _dot(pt.to(do.dtype), do, dv, IEEE)
    dpt = _dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
    dst = pt * (dpt - delta[None, :])
    dk = _dot(dst.to(q.dtype), q, dk, IEEE)
    return dk, dv


@triton.jit
def _bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, qs_ptr, ql_ptr,
              sqt, sqh, skt, skh, svt, svh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh, scale, qk_scale,
              G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    q_len = tl.load(ql_ptr + req)
    q_start = tl.load(qs_ptr + req)
    k0 = tl.program_id(0) * BLOCK_N  # block 0 has the longest walk and starts first
    if k0 < q_len:
        hq = tl.num_programs(2) * G
        kpos = k0 + tl.arange(0, BLOCK_N)
        kv_ok = kpos < q_len
        krow = (q_start + kpos).to(tl.int64)
        d = tl.arange(0, D)
        k = tl.load(k_ptr + krow[:, None] * skt + kvh * skh + d[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_ptr + krow[:, None] * svt + kvh * svh + d[None, :], mask=kv_ok[:, None], other=0.0)
        dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        n_blocks = (q_len + BLOCK_M - 1) // BLOCK_M
        # q blocks from the one holding key k0; those before i_full hold a token earlier than
        # some key of this block (the causal edge, and every block when keys run past q_len).
        # One flat walk over (q block, head in the group), head fastest, so the loads pipeline.
        i_full = tl.minimum((k0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M, n_blocks)
        for j in range((k0 // BLOCK_M) * G, i_full * G):
            dk, dv = _dkdv_step(dk, dv, k, v, kpos, q_ptr, do_ptr, lse_ptr, delta_ptr, q_start, q_len, j // G,
                                kvh * G + j % G, hq, sqt, sqh, sdot, sdoh, qk_scale, True, BLOCK_M, BLOCK_N, D, IEEE)
        for j in range(i_full * G, n_blocks * G):
            dk, dv = _dkdv_step(dk, dv, k, v, kpos, q_ptr, do_ptr, lse_ptr, delta_ptr, q_start, q_len, j // G,
                                kvh * G + j % G, hq, sqt, sqh, sdot, sdoh, qk_scale, False, BLOCK_M, BLOCK_N, D, IEEE)
        dk = dk * scale
        tl.store(dk_ptr + krow[:, None] * sdkt + kvh * sdkh + d[None, :], dk.to(dk_ptr.dtype.element_ty),
                 mask=kv_ok[:, None])
        tl.store(dv_ptr + krow[:, None] * sdvt + kvh * sdvh + d[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=kv_ok[:, None])


def _inner_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_varlen_backward(q, k, v, out, lse, dout, cu_seqlens, *, scale=None, max_seqlen=None, config=None,
                              kv_grad_dtype=None):
    """(dq, dk, dv) of attention_varlen(q, k, v, cu_seqlens, scale=scale) given its out, its lse
    (float32 [T, Hq], natural log: attention_varlen(..., return_lse=True)) and dout = dL/dout.

    q, out, dout [T, Hq, D]; k, v [T, Hkv, D]; cu_seqlens [B+1]. Gradients come back in the
    inputs' dtypes (dk and dv in kv_grad_dtype where given: float32 keeps the kernel's fp32 sums
    unrounded, for a caller that adds partials, as context parallelism's pieces do); rows outside
    cu_seqlens[0]:cu_seqlens[-1] get zeros.
    """
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"attention_varlen_backward: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if out.shape != q.shape or dout.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:2]):
        raise ValueError("attention_varlen_backward: out/dout must match q and lse be [T, Hq]")
    if not (q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype):
        raise ValueError("attention_varlen_backward: q, k, v, out, dout must share a dtype")
    T, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or d & (d - 1):
        raise ValueError(f"attention_varlen_backward: Hq={hq} must be a multiple of Hkv={hkv}, D={d} a power of two")
    G = hq // hkv
    cfg = config or bwd_config(d, G, str(q.dtype).removeprefix("torch."))
    if cfg.dq_block_m < G:
        raise ValueError(f"attention_varlen_backward: dq_block_m={cfg.dq_block_m} must hold one token's G={G} query heads")
    q, k, v, out, dout = (_inner_contiguous(x) for x in (q, k, v, out, dout))
    lse = lse.to(torch.float32).contiguous()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    q_start = cu[:-1].contiguous()
    q_len = (cu[1:] - cu[:-1]).contiguous()
    if max_seqlen is None:
        max_seqlen = int(q_len.max()) if q_len.numel() else 0
    elif q_len.numel():  # the caller's bound sizes the grid: a shorter one would leave rows without gradients
        torch._assert_async((q_len <= max_seqlen).all(), "attention_varlen_backward: a sequence is longer than max_seqlen")
    dq = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
    dk, dv = (torch.zeros(x.shape, device=x.device, dtype=kv_grad_dtype or x.dtype) for x in (k, v))
    if max_seqlen == 0:
        return dq, dk, dv
    scale = d ** -0.5 if scale is None else float(scale)
    qk_scale = scale * _LOG2E
    B = q_len.shape[0]
    ieee = q.dtype == torch.float32
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    delta = torch.empty((T, hq), device=q.device, dtype=torch.float32)  # read only inside sequences
    n_tiles = cdiv(max_seqlen, cfg.dq_block_m // G)
    _bwd_delta_fast[(n_tiles, B, hkv)](out, dout, delta, q_start, q_len, out.stride(0), out.stride(1), dout.stride(0),
                                  dout.stride(1), n_tiles, G=G, BLOCK_M=cfg.dq_block_m, D=d, **launch)
    _bwd_dq_fast[(n_tiles, B, hkv)](
        q, k, v, dout, lse, delta, dq, q_start, q_len, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), scale, qk_scale, n_tiles,
        G=G, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, D=d, IEEE=ieee, **launch)
    _bwd_dkdv_fast[(cdiv(max_seqlen, cfg.block_n), B, hkv)](
        q, k, v, dout, lse, delta, dk, dv, q_start, q_len, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), scale, qk_scale, G=G, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, IEEE=ieee, **launch)
    return dq, dk, dv


__all__ = ["AttentionBwdConfig", "bwd_config", "attention_varlen_backward"]

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_bwd_delta_fast = fast(_bwd_delta)
_bwd_dq_fast = fast(_bwd_dq)
_bwd_dkdv_fast = fast(_bwd_dkdv)
