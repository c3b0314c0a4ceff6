"""Differentiable vocab-parallel logprob for tensor-parallel training.

What this module decides: the backward of `vocab_parallel_logprob` under the linear-logprob
contract. The global log-sum-exp is the forward's (the ranks' per-tile (m, l) merged by the
contract's tile tree); the backward recomputes each local tile in fixed order with the strict
implementation's GEMM and exp, and tree-reduces dL/dhidden over ranks.
"""
from __future__ import annotations

import itertools

import torch

from ..backends.reference import logprob as _lp
from ..contracts.logprob import VOCAB_TILE
from . import token_segments as _ts
from .collectives import strict_prims, tree_all_reduce, vocab_parallel_logprob


class VocabParallelLogprob(torch.autograd.Function):
    """Differentiable vocab-parallel logprob (TP>1 training). Forward: rk.vocab_parallel_logprob and its
    global log-sum-exp; the backward recomputes each local tile and tree-reduces dL/dhidden."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, start, vocab_size, temperature, group, segment_rows=None):
        lp, lse = vocab_parallel_logprob(hidden, weight, targets, vocab_start=start, vocab_size=vocab_size, temperature=temperature,
                                         group=group, return_lse=True, check=False)  # (rank * rows: megatron_spec's head)
        prims, shard = strict_prims(hidden.device), weight.shape[0]
        lo, hi = min(group.rank() * shard, vocab_size), min((group.rank() + 1) * shard, vocab_size)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.span = (lo, hi)
        ctx.start, ctx.temperature, ctx.group, ctx.prims = start, temperature, group, prims
        # canonical vocab segments of the backward's dL/dhidden (TP_BACKWARD_REFERENCE): this rank's share of the S_v
        # segments of `segment_rows` rows; None: one segment per rank (the sum then depends on the TP size)
        ctx.segments = None if segment_rows is None else [(start + j * segment_rows, start + (j + 1) * segment_rows)
                                                          for j in range(-(-weight.shape[0] // segment_rows))]
        ctx.tokens, ctx.param = _ts.current(), weight
        if ctx.tokens is not None and (ctx.tokens.row_splits is None or sum(ctx.tokens.row_splits) != hidden.shape[0]):
            raise ValueError(f"token-segmented logprob head: row splits {ctx.tokens.row_splits} do not cover its {hidden.shape[0]} rows")
        return lp

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        args = (ctx.start, ctx.span, ctx.segments, ctx.temperature, ctx.prims)
        if ctx.tokens is None:
            partials, gw = local_backward(hidden, weight, targets, lse, grad.float(), *args)
        else:  # one token segment's rows at a time (dL/dhidden is per row: the same bits joined), dW per segment
            cuts = [0, *itertools.accumulate(ctx.tokens.row_splits)]
            pieces, gws = [], []
            for a, b in zip(cuts[:-1], cuts[1:]):
                if b > a:
                    p, g_w = local_backward(hidden[a:b], weight, targets[a:b], lse[a:b], grad[a:b].float(), *args)
                    pieces.append(p)
                    gws.append(g_w)
                else:
                    gws.append(torch.zeros_like(weight, dtype=torch.float32))
            partials = [torch.cat([p[j] for p in pieces]) for j in range(len(pieces[0]))] if pieces else \
                [torch.zeros_like(hidden, dtype=torch.float32) for _ in (ctx.segments or [None])]
            _ts.deposit(ctx.param, torch.stack(gws))
            gw = None
        gh = tree_all_reduce(partials, ctx.group, check=False)  # every rank's vocab segments contribute to dL/dhidden, one tree
        return gh.to(hidden.dtype), (None if gw is None else gw.to(weight.dtype)), None, None, None, None, None, None


CHUNK_ELEMENTS = 1 << 24  # float32 grad-logits per chunk (64 MiB): how many tiles run at once, never their bits


def local_backward(hidden, weight, targets, lse, g, start, span, segments, temperature, prims):
    """(dL/dhidden partial of each of this rank's vocab segments [T, H] float32, dL/dweight [shard, H] float32).

    The contract, per segment: dz of each VOCAB_TILE tile (z recomputed by the strict GEMM on the hidden in the
    lm_head's dtype — the forward's logits —, p = exp(z - lse), dz = (onehot - p) * g / T in float32, then rounded
    once to the lm_head's dtype: the operand of both backward GEMMs, as in the single-process backward and in a
    native bf16 output layer), dh = ((0 + dz_0 W_0) + dz_1 W_1) + ... in tile order, dW_tile = dz_tile^T h. A
    float32 lm_head keeps every step in float32. The tiles run in chunks: one GEMM gives a chunk's logits (each
    column's bits are its tile's: the GEMM is column invariant), the element-wise steps act on the chunk at once
    (the target's +1 by a mask, no host sync), one GEMM gives the chunk's dW rows (row invariant); only dh's partials
    stay per tile, in order (one call for a chunk's tiles where the implementation has `fold_matmul`)."""
    lo, hi = span
    h = hidden.to(weight.dtype)  # the backward GEMMs' operand (no copy where it already has that dtype)
    fused, local = _fused_dz(prims, weight, targets, start)
    gw = torch.zeros_like(weight, dtype=torch.float32)
    tiles_per_chunk = max(1, min(64, CHUNK_ELEMENTS // max(1, h.shape[0] * VOCAB_TILE)))
    partials = []
    for seg_lo, seg_hi in segments or [(lo, hi)]:
        gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        a0, a1 = max(seg_lo, lo), min(seg_hi, hi)
        for c0 in range(a0, a1, tiles_per_chunk * VOCAB_TILE):
            c1 = min(c0 + tiles_per_chunk * VOCAB_TILE, a1)
            if fused:
                gz = prims.grad_z(h, weight, local, lse, g, temperature, c0 - start, c1 - start)
            else:
                z = _lp.tile_logits(h, weight, c0 - start, c1 - start, temperature, prims)
                gz = -prims.exp(z - lse[:, None])
                hit = targets[:, None] == torch.arange(c0, c1, device=targets.device)[None, :]
                gz = torch.where(hit, gz + 1.0, gz)
                gz = (gz * g[:, None] / temperature).to(weight.dtype)
            gw[c0 - start:c1 - start] = prims.matmul(gz.t(), h)
            if prims.fold_matmul is not None:  # the same fold in one call (tiles from c0, as below)
                gh = prims.fold_matmul(gh, gz, weight[c0 - start:c1 - start], VOCAB_TILE)
                continue
            for a in range(c0, c1, VOCAB_TILE):  # fixed tile order inside a segment
                b = min(a + VOCAB_TILE, c1)
                gh = gh + prims.matmul(gz[:, a - c0:b - c0], weight[a - start:b - start])
        partials.append(gh)
    return partials, gw


def _fused_dz(prims, weight, targets, start):
    """(whether dz comes from the implementation's fused kernel, the targets in the shard's row numbering): a bf16 /
    fp16 head on an implementation with `grad_z` (the Triton backend: the tile's logits, p = exp2((z - lse) log2 e)
    and dz in one kernel, nothing float32 of the vocabulary's size stored); a float32 head keeps the composition."""
    fused = prims.grad_z is not None and weight.dtype in (torch.bfloat16, torch.float16)
    return fused, (targets - start if fused else None)


def local_backward_per_tile(hidden, weight, targets, lse, g, start, span, segments, temperature, prims):
    """`local_backward`'s definition, one VOCAB_TILE tile at a time (slow: tests and scripts/gpu_strict_parity.py
    compare the chunked one with it, bit for bit)."""
    lo, hi = span
    h = hidden.to(weight.dtype)  # the backward GEMMs' operand (no copy where it already has that dtype)
    fused, local = _fused_dz(prims, weight, targets, start)
    gw = torch.zeros_like(weight, dtype=torch.float32)
    partials = []
    for seg_lo, seg_hi in segments or [(lo, hi)]:
        gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for a in range(max(seg_lo, lo), min(seg_hi, hi), VOCAB_TILE):
            b = min(a + VOCAB_TILE, hi)
            if fused:
                gz = prims.grad_z(h, weight, local, lse, g, temperature, a - start, b - start)
            else:
                z = _lp.tile_logits(h, weight, a - start, b - start, temperature, prims)
                gz = -prims.exp(z - lse[:, None])
                rows = ((targets >= a) & (targets < b)).nonzero()[:, 0]
                gz[rows, targets[rows] - a] += 1.0
                gz = (gz * g[:, None] / temperature).to(weight.dtype)
            gh = gh + prims.matmul(gz, weight[a - start:b - start])
            gw[a - start:b - start] = prims.matmul(gz.t(), h)
        partials.append(gh)
    return partials, gw


def vocab_parallel_logprob_fn(hidden, weight, targets, start, vocab_size, temperature, group, segment_rows=None):
    """Differentiable float32 log p(targets) with the lm_head split over `group` by vocab rows. With `segment_rows`
    (rows per canonical vocab segment, the shard a whole number of them) dL/dhidden is TP invariant. Every rank holds
    weight.shape[0] rows from start = rank * that (the layout whose ranges the forward computes instead of gathering:
    vocab_parallel_logprob(check=False); another start raises)."""
    return VocabParallelLogprob.apply(hidden, weight, targets, start, vocab_size, temperature, group, segment_rows)
