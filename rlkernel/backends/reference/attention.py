"""Attention under the strict contract (contracts/attention.py): composition and shared backward.

Both entry points (packed varlen prefill, queries against a paged cache) gather keys into
position order and call one core, `attend`; the paged cache layout [num_blocks, block_size,
kv_heads, head_dim] is rlkernel's own (the strict backend owns both the write and the read).
The native implementation (backends/native.py) reuses the gathering with SDPA as its core.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...contracts.attention import ATTN_CHUNK
from .linear import wants_grad
from .primitives import REFERENCE, Prims, tree_sum


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, L, Hkv, D] -> [B, Hq, L, D], kv head h serving query heads h*groups .. h*groups+groups-1."""
    x = x.transpose(1, 2)
    b, hkv, L, d = x.shape
    return x[:, :, None].expand(b, hkv, groups, L, d).reshape(b, hkv * groups, L, d)


def attend(q, qpos, k, v, scale, prims: Prims = REFERENCE, with_lse: bool = False):
    """Core, batched over requests: q [B, n, Hq, D] at absolute positions qpos [B, n];
    k/v [B, L, Hkv, D] at positions 0..L-1 (zero-padded past each request's length).
    Returns float32 out [B, n, Hq, D] (and lse [B, n, Hq]).

    Every output is computed from its own row's chains, and chunks past a query's position are
    exact identities, so a request's bits do not depend on its batch.
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
    kf = expand_kv(kf, groups).reshape(b * hq, span, d)
    vf = expand_kv(vf, groups).reshape(b * hq, span, d)
    qf = q.float().transpose(1, 2).reshape(b * hq, n, d)
    qp = qpos[:, None, :].expand(b, hq, n).reshape(b * hq, n)
    m = torch.full((b * hq, n), -math.inf, device=q.device)
    l = torch.zeros((b * hq, n), device=q.device)
    o = torch.zeros((b * hq, n, d), device=q.device)
    for c in range(nchunks):
        lo, hi = c * ATTN_CHUNK, (c + 1) * ATTN_CHUNK
        s = prims.matmul(qf, kf[:, lo:hi].transpose(1, 2)) * scale  # [B*Hq, n, C]
        kpos = torch.arange(lo, hi, device=q.device)
        s = s.masked_fill(kpos[None, None, :] > qp[:, :, None], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = prims.exp(m - m_new)
        p = prims.exp(s - m_new[..., None])
        l = l * alpha + tree_sum(p, dim=-1)
        o = o * alpha[..., None] + prims.matmul(p, vf[:, lo:hi])
        m = m_new
    out = (o / l[..., None]).reshape(b, hq, n, d).transpose(1, 2)
    if not with_lse:
        return out
    return out, (m + prims.log(l)).reshape(b, hq, n).transpose(1, 2)


def gather_padded(x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width, ...]: rows starts[b] .. starts[b]+lens[b]-1 of x, exact zeros past lens[b]."""
    j = torch.arange(width, device=x.device)
    valid = j[None, :] < lens[:, None]
    idx = torch.where(valid, starts[:, None] + j[None, :], starts[:, None].clamp(max=max(x.shape[0] - 1, 0)))
    out = x[idx]
    return torch.where(valid.reshape(*valid.shape, *([1] * (x.dim() - 1))), out, torch.zeros((), dtype=x.dtype, device=x.device))


def run_batched(core, q, q_starts, q_lens, first_pos, keys, values, key_lens, scale):
    """One batched core call for all requests; returns the real query rows in request order
    (a tuple when the core returns one)."""
    keep = q_lens > 0
    if not bool(keep.any()):
        return q.new_zeros(q.shape)
    q_starts, q_lens, first_pos, keys, values, key_lens = (t[keep] for t in (q_starts, q_lens, first_pos, keys, values, key_lens))
    n = int(q_lens.max())
    j = torch.arange(n, device=q.device)
    real = j[None, :] < q_lens[:, None]
    qb = gather_padded(q, q_starts, q_lens, n)
    qpos = torch.where(real, first_pos[:, None] + j[None, :], torch.zeros_like(j)[None, :])  # padded rows: position 0, discarded
    L = int(key_lens.max())
    res = core(qb, qpos, keys[:, :L], values[:, :L], scale)
    return tuple(r[real] for r in res) if isinstance(res, tuple) else res[real]


def varlen(core, q, k, v, cu_seqlens, scale):
    cu = cu_seqlens.to(q.device).long()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    width = int(lens.max()) if lens.numel() else 0
    keys, values = gather_padded(k, starts, lens, width), gather_padded(v, starts, lens, width)
    return run_batched(core, q, starts, lens, torch.zeros_like(lens), keys, values, lens, scale)


def paged(core, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
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
    return run_batched(core, q, qsl[:-1], q_lens, lens - q_lens, keys, values, lens, scale)


def varlen_lse(q, k, v, cu_seqlens, scale, prims: Prims = REFERENCE):
    """(float32 out [T, Hq, D], float32 lse [T, Hq]) of packed causal attention: the composition."""
    return varlen(lambda *a: attend(*a, prims=prims, with_lse=True), q, k, v, cu_seqlens, scale)


def varlen_backward(q, k, v, out, lse, cu_seqlens, scale, g, prims: Prims):
    """Gradients of packed causal attention from its output and per-query log-sum-exp, batched
    over requests: P = exp(S - lse) on the causal mask, dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = dS K scale, dK = dS^T Q scale, kv-head gradients summed over their query heads by a tree.
    Every reduction is a contract GEMM (over keys, queries or d, ascending) or a tree."""
    cu = cu_seqlens.to(q.device).long()
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    b, n = lens.shape[0], int(lens.max())
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    j = torch.arange(n, device=q.device)
    real = j[None, :] < lens[:, None]  # [B, n]
    mm = prims.matmul

    def heads(x):  # packed [T, H, ...] -> [B*H, n, ...], zeros past each request
        p = gather_padded(x.float(), starts, lens, n)
        return p.transpose(1, 2).reshape(b * x.shape[1], n, *x.shape[2:])

    qh, oh, gh, lse_h = heads(q), heads(out), heads(g), heads(lse[..., None])[..., 0]
    kx = expand_kv(gather_padded(k.float(), starts, lens, n), groups).reshape(b * hq, n, d)
    vx = expand_kv(gather_padded(v.float(), starts, lens, n), groups).reshape(b * hq, n, d)
    allowed = (j[:, None] >= j[None, :])[None] & real[:, None, :]  # [B, n_q, n_k]
    allowed = allowed[:, None].expand(b, hq, n, n).reshape(b * hq, n, n)
    s = (mm(qh, kx.transpose(1, 2)) * scale).masked_fill(~allowed, -math.inf)
    p = prims.exp(s - lse_h[..., None])
    dv = mm(p.transpose(1, 2), gh)
    dp = mm(gh, vx.transpose(1, 2))
    ds = p * (dp - tree_sum(gh * oh, dim=-1)[..., None])
    dq = mm(ds, kx) * scale
    dk = mm(ds.transpose(1, 2), qh) * scale

    def packed(x, h):  # [B*H, n, D] -> packed [T, H, D]
        return x.reshape(b, h, n, d).transpose(1, 2)[real]

    dk = tree_sum(dk.reshape(b, hkv, groups, n, d), dim=2).reshape(b * hkv, n, d)
    dv = tree_sum(dv.reshape(b, hkv, groups, n, d), dim=2).reshape(b * hkv, n, d)
    return packed(dq, hq).to(q.dtype), packed(dk, hkv).to(k.dtype), packed(dv, hkv).to(v.dtype)


class VarlenFn(torch.autograd.Function):
    """Forward bits from `fwd_lse` (a kernel or `varlen_lse`) with the shared `varlen_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, fwd_lse, prims):
        out, lse = fwd_lse(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.scale, ctx.prims = scale, prims
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu = ctx.saved_tensors
        return (*varlen_backward(q, k, v, out, lse, cu, ctx.scale, g, ctx.prims), None, None, None, None)


def attention(kind, q, k, v, *args, prims: Prims = REFERENCE, fwd_lse=None, fwd_paged=None, max_query_len=None,
              max_seq_len=None):
    """The op for one implementation: varlen (differentiable) or paged (inference) attention.
    The max_* launch hints are for GPU implementations; nothing here needs them."""
    fwd_lse = fwd_lse or (lambda *a: varlen_lse(*a, prims=prims))
    if kind == "varlen":
        if wants_grad(q, k, v):
            return VarlenFn.apply(q, k, v, *args, fwd_lse, prims)
        return fwd_lse(q, k, v, *args)[0].to(q.dtype)
    if fwd_paged is not None:
        return fwd_paged(q, k, v, *args).to(q.dtype)
    return paged(lambda *a: attend(*a, prims=prims), q, k, v, *args).to(q.dtype)
