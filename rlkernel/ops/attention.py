"""Causal GQA attention: packed variable-length prefill and paged-KV queries.

Strict contract: keys are cut into chunks of ATTN_CHUNK by *absolute key
position* (a fixed split size, never a fixed number of splits). For each chunk
the scores are one fixed-shape fp32 tile GEMM (q rows in tiles of 16), scaled
once; the running (m, l, o) is merged chunk by chunk, left to right, with the
position-independent exp; o / l and one cast at the end. A query's value
therefore depends only on its own q, its position and the keys it sees: packed
prefill, token-by-token decode against a paged cache and chunked prefill at any
boundary give the same bits. Chunks past a query's position are exact
identities (exp(0) == 1, p == 0) so they may be skipped or not.

Both entry points gather keys into position order and call one core,
`_attend`; the paged cache layout [num_blocks, block_size, kv_heads, head_dim]
is rlkernel's own (the strict backend owns both the write and the read).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import dispatch, fused
from ..contract import Contract
from ..primitives import TILE_ROWS, strict_exp, tile_matmul, tree_sum

ATTN_CHUNK = 32

REFERENCE = Contract(
    op="attention",
    backend="reference",
    domain="visible keys",
    partition=(("kv_chunk", ATTN_CHUNK), ("chunk_anchor", "absolute key position"), ("q_tile", TILE_ROWS)),
    merge="online softmax (m, l, o) over kv chunks, left to right; within a chunk: l by balanced tree, o by one fixed-shape GEMM",
    precision=(("q,k,v", "widened to float32"), ("scores", "float32"), ("m,l,o", "float32"), ("output", "q.dtype")),
    rounding=("scores = (q.k) * scale", "p = exp(s - m)", "o / l then one cast to q.dtype"),
    primitives=(("exp", "Cody-Waite + degree-7 Horner, fp32"), ("max", "exact")),
    invariant=("batch", "prefill == decode == chunked prefill", "block size/placement", "threads 1 vs 2", "run to run"),
)
NATIVE = Contract(
    op="attention",
    backend="native",
    domain="visible keys",
    partition=(("kv_split", "library (SDPA)"),),
    merge="torch scaled_dot_product_attention",
    precision=(("q,k,v", "input dtype"), ("output", "q.dtype")),
    rounding=("library",),
    primitives=(("exp", "library"),),
)


def _check(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"attention: want q [T, Hq, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads cannot share {k.shape[1]} kv heads of dim {k.shape[-1]}")


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, L, Hkv, D] -> [B, Hq, L, D], kv head h serving query heads h*groups .. h*groups+groups-1."""
    x = x.transpose(1, 2)
    b, hkv, L, d = x.shape
    return x[:, :, None].expand(b, hkv, groups, L, d).reshape(b, hkv * groups, L, d)


def _attend(q, qpos, k, v, scale):
    """Core, batched over requests: q [B, n, Hq, D] at absolute positions qpos [B, n];
    k/v [B, L, Hkv, D] at positions 0..L-1 (zero-padded past each request's length).

    Requests are independent problems of every batched GEMM and chunks past a query's
    position are exact identities, so a request's bits do not depend on its batch.
    """
    b, n, hq, d = q.shape
    groups = hq // k.shape[2]
    last = int(qpos.max()) + 1
    nchunks = -(-last // ATTN_CHUNK)
    span = nchunks * ATTN_CHUNK
    kf, vf = k[:, :last].float(), v[:, :last].float()
    if span > last:
        kf = F.pad(kf, (0, 0, 0, 0, 0, span - last))
        vf = F.pad(vf, (0, 0, 0, 0, 0, span - last))
    kf = _expand_kv(kf, groups).reshape(b * hq, span, d)
    vf = _expand_kv(vf, groups).reshape(b * hq, span, d)
    qf = q.float().transpose(1, 2).reshape(b * hq, n, d)
    qp = qpos[:, None, :].expand(b, hq, n).reshape(b * hq, n)
    m = torch.full((b * hq, n), -math.inf, device=q.device)
    l = torch.zeros((b * hq, n), device=q.device)
    o = torch.zeros((b * hq, n, d), device=q.device)
    for c in range(nchunks):
        lo, hi = c * ATTN_CHUNK, (c + 1) * ATTN_CHUNK
        s = tile_matmul(qf, kf[:, lo:hi].transpose(1, 2)) * scale  # [B*Hq, n, C]
        kpos = torch.arange(lo, hi, device=q.device)
        s = s.masked_fill(kpos[None, None, :] > qp[:, :, None], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = strict_exp(m - m_new)
        p = strict_exp(s - m_new[..., None])
        l = l * alpha + tree_sum(p, dim=-1)
        o = o * alpha[..., None] + tile_matmul(p, vf[:, lo:hi])
        m = m_new
    out = (o / l[..., None]).reshape(b, hq, n, d).transpose(1, 2)
    return out.to(q.dtype)


def _native_attend(q, qpos, k, v, scale):
    b, n, hq, d = q.shape
    last = int(qpos.max()) + 1
    groups = hq // k.shape[2]
    kk, vv = _expand_kv(k[:, :last], groups), _expand_kv(v[:, :last], groups)
    mask = torch.arange(last, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, n, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


def _gather_padded(x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, ...]: rows starts[b] .. starts[b]+lens[b]-1 of x, exact zeros past lens[b]."""
    j = torch.arange(width, device=x.device)
    valid = j[None, :] < lens[:, None]
    idx = torch.where(valid, starts[:, None] + j[None, :], starts[:, None].clamp(max=max(x.shape[0] - 1, 0)))
    out = x[idx]
    return torch.where(valid.reshape(*valid.shape, *([1] * (x.dim() - 1))), out, torch.zeros((), dtype=x.dtype, device=x.device))


def _run_batched(attend, q, q_starts, q_lens, first_pos, keys, values, key_lens, scale):
    """One batched core call for all requests; returns the real query rows in request order."""
    keep = q_lens > 0
    if not bool(keep.any()):
        return q.new_zeros(q.shape)
    q_starts, q_lens, first_pos, keys, values, key_lens = (t[keep] for t in (q_starts, q_lens, first_pos, keys, values, key_lens))
    n = int(q_lens.max())
    j = torch.arange(n, device=q.device)
    real = j[None, :] < q_lens[:, None]
    qb = _gather_padded(q, q_starts, q_lens, n)
    qpos = torch.where(real, first_pos[:, None] + j[None, :], torch.zeros_like(j)[None, :])  # padded rows: position 0, discarded
    L = int(key_lens.max())
    return attend(qb, qpos, keys[:, :L], values[:, :L], scale)[real]


def _varlen(attend, q, k, v, cu_seqlens, scale):
    cu = cu_seqlens.to(q.device).long()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    width = int(lens.max()) if lens.numel() else 0
    keys, values = _gather_padded(k, starts, lens, width), _gather_padded(v, starts, lens, width)
    return _run_batched(attend, q, starts, lens, torch.zeros_like(lens), keys, values, lens, scale)


def _paged(attend, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    block = k_cache.shape[1]
    lens = seq_lens.to(q.device).long()
    qsl = query_start_loc.to(q.device).long()
    q_lens = qsl[1:] - qsl[:-1]
    bad = (q_lens > lens).nonzero()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"attention_paged: request {b} has {int(q_lens[b])} queries but only {int(lens[b])} tokens")
    width = int(lens.max()) if lens.numel() else 0
    nblk = -(-width // block)
    blocks = block_tables[: lens.shape[0], :nblk].long()
    valid = (torch.arange(nblk * block, device=q.device)[None, :] < lens[:, None]).reshape(*lens.shape, nblk * block, 1, 1)
    zero = torch.zeros((), dtype=k_cache.dtype, device=q.device)
    keys = torch.where(valid, k_cache[blocks].reshape(lens.shape[0], nblk * block, *k_cache.shape[2:]), zero)
    values = torch.where(valid, v_cache[blocks].reshape(lens.shape[0], nblk * block, *v_cache.shape[2:]), zero)
    return _run_batched(attend, q, qsl[:-1], q_lens, lens - q_lens, keys, values, lens, scale)


def _impl(attend):
    def run(kind, *args):
        return (_varlen if kind == "varlen" else _paged)(attend, *args)

    return run


def _varlen_backward(q, k, v, out, lse, cu_seqlens, scale, g):
    """Gradients of packed causal attention from its output and per-query log-sum-exp, batched
    over requests: P = exp(S - lse) on the causal mask, dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = dS K scale, dK = dS^T Q scale, kv-head gradients summed over their query heads by a tree.
    Every reduction is a tile GEMM or a tree, so the result is deterministic and thread-independent."""
    cu = cu_seqlens.to(q.device).long()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    b, n = lens.shape[0], int(lens.max())
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    j = torch.arange(n, device=q.device)
    real = j[None, :] < lens[:, None]  # [B, n]

    def heads(x):  # packed [T, H, ...] -> [B*H, n, ...], zeros past each request
        p = _gather_padded(x.float(), starts, lens, n)
        return p.transpose(1, 2).reshape(b * x.shape[1], n, *x.shape[2:])

    qh, oh, gh, lse_h = heads(q), heads(out), heads(g), heads(lse[..., None])[..., 0]
    kx = _expand_kv(_gather_padded(k.float(), starts, lens, n), groups).reshape(b * hq, n, d)
    vx = _expand_kv(_gather_padded(v.float(), starts, lens, n), groups).reshape(b * hq, n, d)
    allowed = (j[:, None] >= j[None, :])[None] & real[:, None, :]  # [B, n_q, n_k]
    allowed = allowed[:, None].expand(b, hq, n, n).reshape(b * hq, n, n)
    s = (tile_matmul(qh, kx.transpose(1, 2)) * scale).masked_fill(~allowed, -math.inf)
    p = strict_exp(s - lse_h[..., None])
    dv = tile_matmul(p.transpose(1, 2), gh)
    dp = tile_matmul(gh, vx.transpose(1, 2))
    ds = p * (dp - tree_sum(gh * oh, dim=-1)[..., None])
    dq = tile_matmul(ds, kx) * scale
    dk = tile_matmul(ds.transpose(1, 2), qh) * scale

    def packed(x, h):  # [B*H, n, D] -> packed [T, H, D]
        return x.reshape(b, h, n, d).transpose(1, 2)[real]

    dk = tree_sum(dk.reshape(b, hkv, groups, n, d), dim=2).reshape(b * hkv, n, d)
    dv = tree_sum(dv.reshape(b, hkv, groups, n, d), dim=2).reshape(b * hkv, n, d)
    return packed(dq, hq).to(q.dtype), packed(dk, hkv).to(k.dtype), packed(dv, hkv).to(v.dtype)


class _FusedVarlen(torch.autograd.Function):
    """Training forward through the fused kernel (the reference bits) with `_varlen_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        out, lse = fused.ops().attention_varlen_lse(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.scale = scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu = ctx.saved_tensors
        return (*_varlen_backward(q, k, v, out, lse, cu, ctx.scale, g), None, None)


def _reference(kind, q, k, v, *args):
    """The reference contract: one fused C++ call on the CPU where it is checked to give the
    composition's bits (rlkernel/fused.py), else the composition."""
    path = fused.route(q, k, v)
    if path is not None and fused.attention_ok(q.shape[-1], k.dtype):
        if path == "kernel":
            out = (fused.ops().attention_varlen if kind == "varlen" else fused.ops().attention_paged)(q, k, v, *args)
            return out.to(q.dtype)
        if kind == "varlen":  # a training forward: fused bits, explicit backward
            return _FusedVarlen.apply(q, k, v, *args)
    return (_varlen if kind == "varlen" else _paged)(_attend, q, k, v, *args)


dispatch.register("attention", "reference", REFERENCE)(_reference)
dispatch.register("attention", "native", NATIVE)(_impl(_native_attend))


def attention_varlen(q, k, v, cu_seqlens, *, scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1] (int)."""
    _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return dispatch.call("attention", backend, (q, k, v), "varlen", q, k, v, cu_seqlens, scale)


def attention_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Queries against a paged KV cache (decode and chunked prefill).

    q [Tq, Hq, D]: request b owns rows query_start_loc[b]:query_start_loc[b+1], which are the
    *last* tokens of its sequence of seq_lens[b] tokens (their keys must already be in the cache).
    k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] (int).
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention_paged: want caches [blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    _check(q, k_cache[0], v_cache[0])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return dispatch.call("attention", backend, (q, k_cache, v_cache), "paged", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy k/v [T, Hkv, D] into the caches at flat slots (block * block_size + offset); exact copies.
    Negative slots (vLLM's padding, PAD_SLOT_ID = -1) are skipped."""
    if fused.active(k, v, k_cache) and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride():
        fused.ops().write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    idx = slot_mapping.long()
    keep = idx >= 0
    t, bs = idx.shape[0], k_cache.shape[1]
    blk, off = idx[keep] // bs, idx[keep] % bs  # (block, offset) indexing works for any cache strides
    k_cache[blk, off] = k[:t][keep].to(k_cache.dtype)
    v_cache[blk, off] = v[:t][keep].to(v_cache.dtype)
