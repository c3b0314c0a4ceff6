"""Fused linear-logprob in Triton under contracts.LogprobContract.

hidden [T, H] x lm_head [V, H] -> float32 log p(target). Vocab tiles of the GEMM's
block_n: each tile's logits are the GemmContract accumulator of the (V, H) class, divided
by the temperature; the tile emits its (m, l) and, where it owns the target, the target
logit. A second kernel merges the tiles' (m, l) by one balanced binary tree over tile
index (identity-padded to a power of two). The full logits never exist.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contracts as C
from .gemm import _ensure_allocator, _num_sms, _tma_ok
from .tile import _k_loop, _tile_coords
from .launch import fast, cdiv, next_pow2


@triton.jit(do_not_specialize=["M"])
def _logits_stats_kernel(a_ptr, b_ptr, tgt_ptr, ml_ptr, zt_ptr, M, N, K, vocab, sam, sak, sbn, sbk, inv_temp_unused,
                         temperature, n_vt,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         NUM_PROGS: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr):
    if TMA:
        a_src = tl.make_tensor_descriptor(a_ptr, [M, K], [sam, 1], [BLOCK_M, BLOCK_K])
        b_src = tl.make_tensor_descriptor(b_ptr, [N, K], [sbn, 1], [BLOCK_N, BLOCK_K])
    else:
        a_src = a_ptr
        b_src = b_ptr
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(vocab, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _k_loop(a_src, b_src, off_m, off_n, M, N, K, sam, sak, sbn, sbk,
                      BLOCK_M, BLOCK_N, BLOCK_K, TMA, True, IEEE)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        z = tl.div_rn(acc, temperature)
        z = tl.where(rn[None, :] < vocab, z, float("-inf"))
        m = tl.max(z, 1)
        p = tl.exp2((z - m[:, None]) * 1.4426950408889634)
        l = tl.sum(p, 1)
        row_ok = rm < M
        sidx = rm.to(tl.int64) * n_vt + pid_n
        tl.store(ml_ptr + sidx * 2, m, mask=row_ok)
        tl.store(ml_ptr + sidx * 2 + 1, l, mask=row_ok)
        tgt = tl.load(tgt_ptr + rm, mask=row_ok, other=-1)
        zt = tl.max(tl.where(rn[None, :] == tgt[:, None], z, float("-inf")), 1)
        own = row_ok & (tgt >= off_n) & (tgt < off_n + BLOCK_N)
        tl.store(zt_ptr + rm, zt, mask=own)


@triton.jit(do_not_specialize=["M"])
def _grad_z_kernel(a_ptr, b_ptr, tgt_ptr, lse_ptr, g_ptr, dz_ptr, M, N, K, lo, hi, sam, sak, sbn, sbk, sdm,
                   temperature, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr):
    """dz[t, j] = (onehot(target_t)_j - p_tj) * g_t / T for vocab rows lo + j of one chunk, with
    p = exp(z - lse) from the chunk's logits recomputed in the tile (never stored), written in
    dz's dtype (the operand of the backward GEMMs). Deterministic: element-wise per output."""
    width = hi - lo
    if TMA:
        a_src = tl.make_tensor_descriptor(a_ptr, [M, K], [sam, 1], [BLOCK_M, BLOCK_K])
        b_src = tl.make_tensor_descriptor(b_ptr + lo * sbn, [width, K], [sbn, 1], [BLOCK_N, BLOCK_K])
    else:
        a_src = a_ptr
        b_src = b_ptr + lo * sbn
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(width, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _k_loop(a_src, b_src, off_m, off_n, M, width, K, sam, sak, sbn, sbk,
                      BLOCK_M, BLOCK_N, BLOCK_K, TMA, True, IEEE)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        row_ok = rm < M
        lse = tl.load(lse_ptr + rm, mask=row_ok, other=0.0)
        g = tl.load(g_ptr + rm, mask=row_ok, other=0.0)
        tgt = tl.load(tgt_ptr + rm, mask=row_ok, other=-1)
        z = tl.div_rn(acc, temperature)
        p = tl.exp2((z - lse[:, None]) * 1.4426950408889634)
        onehot = tl.where((lo + rn[None, :]) == tgt[:, None], 1.0, 0.0)
        dz = tl.div_rn((onehot - p) * g[:, None], temperature)
        ok = row_ok[:, None] & (rn[None, :] < width)
        tl.store(dz_ptr + rm[:, None].to(tl.int64) * sdm + rn[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


def grad_z(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
           temperature: float, lo: int, hi: int, *, out_dtype=None, config: C.TileConfig | None = None) -> torch.Tensor:
    """d(g . logprob(targets)) / d(logits[:, lo:hi]) as [T, hi - lo] in out_dtype (default the
    weight's): the linear-logprob backward's operand, one vocab chunk, fused (no fp32 logits)."""
    T, H = hidden.shape
    cfg = config or C.logprob_config(C.dtype_name(hidden.dtype), hi, H)
    dz = torch.empty((T, hi - lo), device=hidden.device, dtype=out_dtype or weight.dtype)
    if T == 0 or hi <= lo:
        return dz
    tiles = cdiv(T, cfg.block_m) * cdiv(hi - lo, cfg.block_n)
    progs = min(_num_sms(hidden.device), tiles)
    tma = _tma_ok(cfg, hidden, weight) and (lo * weight.stride(0) * weight.element_size()) % 16 == 0
    if tma:
        _ensure_allocator()
    _grad_z_kernel_fast[(progs,)](
        hidden, weight, targets.to(torch.int32).contiguous(), lse.contiguous(), g.float().contiguous(), dz, T,
        weight.shape[0], H, lo, hi, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        dz.stride(0), float(temperature), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, NUM_PROGS=progs, TMA=tma, IEEE=hidden.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    return dz


@triton.jit
def _merge_ml(m1, l1, m2, l2):
    m = tl.maximum(m1, m2)
    ms = tl.where(m == float("-inf"), 0.0, m)
    e1 = tl.where(m1 == m, 1.0, tl.exp2((m1 - ms) * 1.4426950408889634))
    e2 = tl.where(m2 == m, 1.0, tl.exp2((m2 - ms) * 1.4426950408889634))
    return m, l1 * e1 + l2 * e2


@triton.jit(do_not_specialize=["M"])
def _tile_tree_kernel(ml_ptr, zt_ptr, out_ptr, stats_ptr, M, n_vt, BLOCK_R: tl.constexpr, NT: tl.constexpr,
                      LEVELS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, NT)
    ok = (rows[:, None] < M) & (cols[None, :] < n_vt)
    idx = rows[:, None].to(tl.int64) * n_vt + cols[None, :]
    m = tl.load(ml_ptr + idx * 2, mask=ok, other=float("-inf"))
    l = tl.load(ml_ptr + idx * 2 + 1, mask=ok, other=0.0)
    for _ in tl.static_range(LEVELS):  # balanced tree: pairs (2i, 2i+1) at every level
        m1, m2 = tl.split(tl.reshape(m, (BLOCK_R, m.shape[1] // 2, 2)))
        l1, l2 = tl.split(tl.reshape(l, (BLOCK_R, l.shape[1] // 2, 2)))
        m, l = _merge_ml(m1, l1, m2, l2)
    m = tl.reshape(m, (BLOCK_R,))
    l = tl.reshape(l, (BLOCK_R,))
    zt = tl.load(zt_ptr + rows, mask=rows < M, other=0.0)
    log_l = tl.log(l)
    tl.store(out_ptr + rows, (zt - m) - log_l, mask=rows < M)
    tl.store(stats_ptr + rows * 2, m, mask=rows < M)
    tl.store(stats_ptr + rows * 2 + 1, log_l, mask=rows < M)


def tile_rows(dtype: torch.dtype) -> int:
    """Vocab rows per tile of the fused kernel for `dtype` (its block_n): the unit of the (m, l) tree."""
    return C.logprob_config(C.dtype_name(dtype), 0, 0).block_n


def tile_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, n_rows: int, *,
               config: C.TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's per-tile partials over weight rows [0, n_rows): ml [T, n_vt, 2] float32, the (m, l) of
    each tile of block_n rows, and zt [T] float32, the target's logit where 0 <= target < n_rows, else 0.0.
    Over a vocab shard starting at a tile boundary these are exactly the tiles `linear_logprob` computes there."""
    T, H = hidden.shape
    cfg = config or C.logprob_config(C.dtype_name(hidden.dtype), n_rows, H)
    n_vt = cdiv(n_rows, cfg.block_n)
    ml = torch.empty((T, n_vt, 2), device=hidden.device, dtype=torch.float32)
    zt = torch.zeros(T, device=hidden.device, dtype=torch.float32)
    if T == 0 or n_vt == 0:
        return ml, zt
    progs = min(_num_sms(hidden.device), cdiv(T, cfg.block_m) * n_vt)
    tma = _tma_ok(cfg, hidden, weight)
    if tma:
        _ensure_allocator()
    _logits_stats_kernel_fast[(progs,)](
        hidden, weight, targets.to(torch.int32).contiguous(), ml, zt, T, weight.shape[0], H, n_rows, hidden.stride(0),
        hidden.stride(1), weight.stride(0), weight.stride(1), 0.0, float(temperature), n_vt,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_PROGS=progs,
        TMA=tma, IEEE=hidden.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False)
    return ml, zt


def merge_tiles(ml: torch.Tensor, zt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p [T], stats [T, 2] = (m, log l)) from every vocab tile's (m, l) in vocab order, merged by the
    kernel's one balanced tree over tile index: `linear_logprob`'s second kernel."""
    T, n_vt = ml.shape[0], ml.shape[1]
    out = torch.empty(T, device=ml.device, dtype=torch.float32)
    stats = torch.empty((T, 2), device=ml.device, dtype=torch.float32)
    if T == 0:
        return out, stats
    nt = next_pow2(n_vt)
    block_r = max(1, min(16, 8192 // nt))
    _tile_tree_kernel_fast[(cdiv(T, block_r),)](ml.contiguous(), zt.contiguous(), out, stats, T, n_vt, BLOCK_R=block_r,
                                                  NT=nt, LEVELS=nt.bit_length() - 1, num_warps=4, enable_fp_fusion=False)
    return out, stats


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   vocab_size: int | None = None, config: C.TileConfig | None = None, return_lse: bool = False,
                   return_stats: bool = False):
    """float32 log p(targets) under softmax(hidden @ weight[:vocab_size].T / temperature).

    return_lse: also lse = m + log(l) [T]; return_stats: (lp, lse, m, log(l)), from which any
    other token's logprob (z - m) - log(l) has the same bits as the kernel's."""
    T, H = hidden.shape
    V = weight.shape[0] if vocab_size is None else vocab_size
    if weight.shape[1] != H or not 0 < V <= weight.shape[0] or targets.shape != (T,):
        raise ValueError(f"linear_logprob: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, V={V}")
    if not temperature > 0:
        raise ValueError("linear_logprob: temperature must be > 0")
    out, stats = merge_tiles(*tile_stats(hidden, weight, targets, temperature, V, config=config))
    m, log_l = stats[:, 0], stats[:, 1]
    if return_stats:
        return out, m + log_l, m, log_l
    return (out, m + log_l) if return_lse else out

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_grad_z_kernel_fast = fast(_grad_z_kernel)
_logits_stats_kernel_fast = fast(_logits_stats_kernel)
_tile_tree_kernel_fast = fast(_tile_tree_kernel)
