"""Context parallelism on the strict path: the packed token stream split across CP ranks.

What this module decides: how attention runs when each CP rank holds a contiguous slice of the
packed stream. Every rank gathers the keys and values of the whole stream (all_gather, rank
order; their gradients come back by the canonical tree, `tree_all_reduce`), then computes
attention for its own queries only: each sequence's piece on the rank is a chunked-prefill
query (positions [a, e) of the sequence, keys [0, e)) run by the attention contract's own
composition (rlkernel.backends.reference.attention.attend: the key chunks in the contract's
order, the same (m, l, o) chain per query row). So every query row gets the bits of CP=1
— the chunked-prefill == packed-prefill invariance the attention tests prove — whatever the
CP size. On the CPU the forward runs the strict op's paged form (the CPU kernels: the rollout
engine's own implementation) and the backward the composition in float32. On CUDA with the Triton
implementation (session 31, written on a CPU: checked under Triton's interpreter in float32,
`scripts/check_cp_pieces.py`; on an H200 in float32 and bfloat16 by `gpu_session.py cp_pieces`, session 31) the forward is one launch of
the packed kernel over every piece (attention_pieces: the paged form's bits, keys by TMA, with the lse)
and the backward the strict attention backward kernel, each piece a sequence of its own whose rows
before its queries are zeros (`triton_pieces_backward`) — the composition there launched one float32
GEMM per head and piece and held the scores of every piece in float32. The backward (one
node, `CPAttention`) runs the rank's queries one token segment at a time: a key's gradient is the
float32 tree over the segments' partials, then over the ranks, cast once. Each rank is one segment
unless token segments are on (rlkernel.parallel.token_segments: S fixed by the run, CP=1 included,
which then runs this path too) — then it is CP invariant; otherwise exact but not CP invariant.
"""
from __future__ import annotations

import math

import torch

from .. import dispatch
from ..backends.reference.attention import attend, expand_kv, gather_padded, run_batched
from ..backends.reference.primitives import tree_sum
from .collectives import _gather, tree_all_reduce


def pieces(cu_seqlens: torch.Tensor, offset: int, length: int) -> tuple[torch.Tensor, ...]:
    """(q_starts, q_lens, first_pos, key_starts, key_lens) of every sequence overlapping tokens [offset, offset+length)."""
    cu = cu_seqlens.long().cpu()
    s, e = cu[:-1], cu[1:]
    a, b = s.clamp(min=offset), e.clamp(max=offset + length)
    keep = b > a
    s, a, b = s[keep], a[keep], b[keep]
    return a - offset, b - a, a - s, s, b - s


def _piece_forward(q, k, v, geometry, scale):
    """Causal attention of local queries q [T_l, Hq, D] against the gathered k/v [T, Hkv, D], piece by piece: the strict
    op's paged form (`rk.attention_paged`, the implementation a rollout engine decodes with — CPU kernels, the Triton
    kernel on CUDA, or the composition), on a page table of block size 1 over the gathered stream: each piece is a
    chunked-prefill request whose keys are rows ks..ks+kl-1. Paged == packed is the attention contract's own
    invariance, so every query row has its CP=1 bits on any device."""
    from ..ops.attention import attention_paged

    qs, ql, fp, ks, kl = (t.to(q.device) for t in geometry)
    out = torch.zeros_like(q)
    n = int(ql.sum()) if ql.numel() else 0
    if n:
        width = int(kl.max())
        table = (ks[:, None] + torch.arange(width, device=q.device)[None, :]).clamp(max=k.shape[0] - 1).to(torch.int32)
        qsl = torch.cat([qs[:1], qs + ql]).to(torch.int32)  # the pieces are the local rows' contiguous runs, in order
        out[qs[0]:qs[0] + n] = attention_paged(q[qs[0]:qs[0] + n], k.reshape(k.shape[0], 1, *k.shape[1:]),
                                               v.reshape(v.shape[0], 1, *v.shape[1:]), table, kl.to(torch.int32), qsl - qs[0],
                                               scale=scale, backend="strict", max_query_len=int(ql.max()), max_seq_len=width)
    return out


def _piece_backward(q, k, v, out, g, geometry, scale, prims):
    """(dq [T_l, Hq, D], dk, dv [T, Hkv, D]) float32 of the pieces `geometry` describes (rows of q outside them: zero):
    the composition, the per-row log-sum-exp recomputed from the scores (exact in float32)."""
    qs, ql, fp, ks, kl = (t.to(q.device) for t in geometry)
    dq_full = torch.zeros(q.shape, device=q.device)
    dk_full, dv_full = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)
    if not ql.numel():
        return dq_full, dk_full, dv_full
    mm = prims.matmul
    b, hq, hkv, d = ql.shape[0], q.shape[1], k.shape[1], q.shape[2]
    groups, nq, nk = hq // hkv, int(ql.max()), int(kl.max())
    jq, jk = torch.arange(nq, device=q.device), torch.arange(nk, device=q.device)
    real_q, real_k = jq[None, :] < ql[:, None], jk[None, :] < kl[:, None]

    def heads(x, starts, lens, n):  # [rows, H, ...] -> [B*H, n, ...]
        p = gather_padded(x.float(), starts, lens, n)
        return p.transpose(1, 2).reshape(b * x.shape[1], n, *x.shape[2:])

    qh, oh, gh = heads(q, qs, ql, nq), heads(out, qs, ql, nq), heads(g, qs, ql, nq)
    kx = expand_kv(gather_padded(k.float(), ks, kl, nk), groups).reshape(b * hq, nk, d)
    vx = expand_kv(gather_padded(v.float(), ks, kl, nk), groups).reshape(b * hq, nk, d)
    qpos = fp[:, None] + jq[None, :]
    allowed = (jk[None, None, :] <= qpos[:, :, None]) & real_q[:, :, None] & real_k[:, None, :]
    allowed = allowed[:, None].expand(b, hq, nq, nk).reshape(b * hq, nq, nk)
    s = (mm(qh, kx.transpose(1, 2)) * scale).masked_fill(~allowed, -math.inf)
    lse_h = torch.logsumexp(s, dim=-1).masked_fill(~real_q.repeat_interleave(hq, dim=0), 0.0)  # padded rows: no keys
    p = prims.exp(s - lse_h[..., None]).masked_fill(~allowed, 0.0)
    dv = mm(p.transpose(1, 2), gh)
    dp = mm(gh, vx.transpose(1, 2))
    ds = p * (dp - tree_sum(gh * oh, dim=-1)[..., None])
    dq = mm(ds, kx) * scale
    dk = mm(ds.transpose(1, 2), qh) * scale
    rows_q = (qs[:, None] + jq[None, :])[real_q]
    dq_full[rows_q] = dq.reshape(b, hq, nq, d).transpose(1, 2)[real_q]
    dk = tree_sum(dk.reshape(b, hkv, groups, nk, d), dim=2).transpose(1, 2)[real_k]  # [rows, Hkv, D]
    dv = tree_sum(dv.reshape(b, hkv, groups, nk, d), dim=2).transpose(1, 2)[real_k]
    idx = (ks[:, None] + jk[None, :])[real_k]  # each sequence has one piece here: no key twice
    dk_full[idx], dv_full[idx] = dk, dv
    return dq_full, dk_full, dv_full


# ---- on the GPU (the Triton implementation): the packed kernel's pieces forward, the FlashAttention-2-shaped backward ----

def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built index tensor on `device`: on CUDA through pinned memory, without waiting for the device."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _rows(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """cat(arange(s, s + n) for s, n in zip(starts, lens)) on the host (int64)."""
    if not lens.numel():
        return torch.zeros(0, dtype=torch.long)
    return torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens) + torch.arange(int(lens.sum()))


def triton_pieces_forward(q, k, v, geometry, scale):
    """(out, lse float32) of the local queries q [T_l, Hq, D] against the gathered k/v [T, Hkv, D]: every piece (the
    host's `pieces` geometry) in one launch of the packed kernel (attention.attention_pieces: keys by TMA, chunks
    anchored at each sequence's first key — the bits of the paged form the CPU path runs and of attention_varlen), the
    host's bounds for the grid (no read-back). Rows outside the pieces (the stream's padding): zeros."""
    from ..backends.triton.attention import attention_pieces

    qs, ql, fp, ks, kl = geometry
    if not ql.numel():
        return torch.zeros_like(q), torch.zeros(q.shape[:2], device=q.device, dtype=torch.float32)
    idx = _to_device(torch.stack([qs, ql, ks, kl]).to(torch.int32), q.device)
    out, lse = attention_pieces(q, k, v, idx[0], idx[1], idx[2], idx[3], max_query_len=int(ql.max()),
                                max_kv_len=int(kl.max()), scale=scale, return_lse=True)
    a, b = int(qs[0]), int(qs[0] + ql.sum())  # the pieces are the local rows' contiguous runs, in order
    for t in (out, lse):  # the rows no piece wrote (the kernel leaves them as allocated): zeros, in place
        t[:a].zero_()
        t[b:].zero_()
    return out, lse


def triton_pieces_backward(q, k, v, out, lse, g, geometry, scale):
    """(dq [T_l, Hq, D], dk, dv [T, Hkv, D]) float32 of the pieces `geometry` describes (rows outside them: zero), by
    the strict GPU attention backward (attention_bwd.attention_varlen_backward). Each piece becomes a sequence of its
    own: its kl keys (gathered rows ks ..) with the piece's queries, outputs, lse and dO at its last ql positions and
    zeros before them — rows whose dO and delta are zero add exact zeros to every key's gradient, so a key's gradient
    sums the piece's queries alone, in the kernel's fixed walk anchored at the sequence's first key: a function of the
    piece (and so of the token segment) alone, never of the CP layout. dk / dv come back in float32 (the partials
    the canonical tree merges); each key appears in one piece here."""
    from ..backends.triton.attention_bwd import attention_varlen_backward

    qs, ql, fp, ks, kl = geometry
    dq = torch.zeros(q.shape, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)
    if not ql.numel():
        return dq, dk, dv
    vstart = torch.cumsum(kl, 0) - kl  # each piece's first row in the virtual packed stream
    cu_v = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(kl, 0)])
    parts = (_rows(vstart + fp, ql), _rows(qs, ql), _rows(ks, kl), cu_v)
    sizes = [len(p) for p in parts]
    vrows, lrows, krows, cu_v = _to_device(torch.cat(parts), q.device).split(sizes)
    n_v = int(kl.sum())

    def virtual(x):
        y = x.new_zeros((n_v, *x.shape[1:]))
        y[vrows] = x[lrows]
        return y

    dq_v, dk_v, dv_v = attention_varlen_backward(virtual(q), k[krows], v[krows], virtual(out), virtual(lse),
                                                 virtual(g.to(q.dtype)), cu_v.to(torch.int32), scale=scale,
                                                 max_seqlen=int(kl.max()), kv_grad_dtype=torch.float32)
    dq[lrows] = dq_v[vrows].float()
    dk[krows], dv[krows] = dk_v, dv_v
    return dq, dk, dv


class CPAttention(torch.autograd.Function):
    """Strict causal attention of this CP rank's queries q [T_l, Hq, D] against the keys and values of the whole stream:
    k/v [T_l, Hkv, D] of every rank gathered in rank order; the forward by pieces (`_piece_forward`). Backward, one
    token segment at a time (`n`: this rank's equal slices of its tokens, each with its own pieces): the queries of a
    segment give their dq rows and float32 partials of every key's and value's gradient; the partials are merged by the
    canonical tree over the rank's segments, then over the ranks (an aligned subtree: the same tree as one rank with
    every segment), and cast once to k's dtype — so under token segments (token_segments.py) the gradients do not depend
    on the CP size. Without them each rank is one segment (exact, not CP invariant)."""

    @staticmethod
    def forward(ctx, q, k_local, v_local, cu_seqlens, offset, group, scale, prims, n, triton=False):
        k = _gather(k_local, group).reshape(-1, *k_local.shape[1:])
        v = _gather(v_local, group).reshape(-1, *v_local.shape[1:])
        geometry = pieces(cu_seqlens, offset, q.shape[0])
        if triton:
            out, lse = triton_pieces_forward(q, k, v, geometry, scale)
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            out = _piece_forward(q, k, v, geometry, scale)
            ctx.save_for_backward(q, k, v, out)
        ctx.cu, ctx.offset, ctx.group, ctx.scale, ctx.prims, ctx.n = cu_seqlens, offset, group, scale, prims, n
        ctx.triton = triton
        ctx.rank = torch.distributed.get_rank(group) if group is not None and group.size() > 1 else 0
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, *lse = ctx.saved_tensors
        t_l, n = q.shape[0], ctx.n
        seg = t_l // n
        dq = torch.zeros(q.shape, device=q.device)
        dks, dvs = [], []
        for j in range(n):  # each segment alone: pieces relative to the rank's rows, so q/out/g are indexed as before
            qs, ql, fp, ks, kl = pieces(ctx.cu, ctx.offset + j * seg, seg)
            if ctx.triton:
                dq_j, dk_j, dv_j = triton_pieces_backward(q, k, v, out, lse[0], g, (qs + j * seg, ql, fp, ks, kl), ctx.scale)
            else:
                dq_j, dk_j, dv_j = _piece_backward(q, k, v, out, g, (qs + j * seg, ql, fp, ks, kl), ctx.scale, ctx.prims)
            dq = dq + dq_j  # disjoint rows: each row's value from one segment, exactly
            dks.append(dk_j)
            dvs.append(dv_j)
        dk = tree_all_reduce([tree_sum(torch.stack(dks), dim=0)], ctx.group, check=False)
        dv = tree_all_reduce([tree_sum(torch.stack(dvs), dim=0)], ctx.group, check=False)
        rows = slice(ctx.rank * t_l, (ctx.rank + 1) * t_l)
        return dq.to(q.dtype), dk[rows].to(k.dtype), dv[rows].to(v.dtype), None, None, None, None, None, None, None


def cp_attention(q, k_local, v_local, cu_seqlens, offset: int, group, scale: float | None = None) -> torch.Tensor:
    """Strict causal attention of this CP rank's queries (tokens [offset, offset + T_l) of the packed stream described by
    cu_seqlens) against every earlier key of their sequences; k/v of the whole stream are gathered from the group. Under
    token segments (rlkernel.parallel.token_segments) the backward runs segment by segment (CP invariant)."""
    from .token_segments import current

    impl = dispatch.resolve("attention", q.device, "strict")
    dispatch.note_call("attention", impl, (q, k_local, v_local))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    state = current()
    n = 1 if state is None else state.n_local
    if q.shape[0] % n:
        raise ValueError(f"cp_attention: {q.shape[0]} local tokens do not split into {n} token segments")
    # on the GPU the Triton implementation's kernels (the packed pieces forward, its backward); elsewhere the paged form
    # and the composition's backward
    triton = impl.name == "triton" and q.is_cuda
    return CPAttention.apply(q, k_local, v_local, cu_seqlens, offset, group, scale, impl.prims, n, triton)


class GatherRows(torch.autograd.Function):
    """Rows of a per-token result ([n_r, ...] on rank r, n_r = counts[r]) concatenated in rank order on every rank, for a
    loss every rank then computes identically; backward: this rank's slice of the (identical) gradient, no sum."""

    @staticmethod
    def forward(ctx, x, counts: tuple, group):
        rank = torch.distributed.get_rank(group) if group is not None and group.size() > 1 else 0
        ctx.start, ctx.n = sum(counts[:rank]), counts[rank]
        width = max(counts)
        pad = torch.zeros((width - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        every = _gather(torch.cat([x, pad]), group)  # [world, width, ...]
        return torch.cat([every[r, :c] for r, c in enumerate(counts)])

    @staticmethod
    def backward(ctx, g):
        return g[ctx.start:ctx.start + ctx.n], None, None
