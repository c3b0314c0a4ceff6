"""Linear-logprob under the strict contract (contracts/logprob.py): composition and shared backward.

Only one tile of logits exists at a time, forward and backward (the backward recomputes each
tile). `tile_stats` / `tree_merge_ml` are the pieces the vocab-parallel op (rlkernel/parallel)
reuses, so a TP group reproduces this tree rank block by rank block.
"""
from __future__ import annotations

import math

import torch

from ...contracts.logprob import VOCAB_TILE
from .linear import wants_grad
from .primitives import REFERENCE, Prims, tree_sum


def merge_ml(m1, l1, m2, l2, prims: Prims = REFERENCE):
    """Merge two (max, sum-of-exp) pairs; (-inf, 0) is an exact identity."""
    m = torch.maximum(m1, m2)
    safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    return m, l1 * prims.exp(m1 - safe) + l2 * prims.exp(m2 - safe)


def tree_merge_ml(ms: list, ls: list, prims: Prims = REFERENCE):
    """Balanced binary tree over a list of (m, l), identity-padded to a power of two."""
    n = len(ms)
    p = 1 << max(n - 1, 0).bit_length()
    ms = list(ms) + [torch.full_like(ms[0], -math.inf)] * (p - n)
    ls = list(ls) + [torch.zeros_like(ls[0])] * (p - n)
    while len(ms) > 1:
        pairs = [merge_ml(ms[i], ls[i], ms[i + 1], ls[i + 1], prims) for i in range(0, len(ms), 2)]
        ms, ls = [a for a, _ in pairs], [b for _, b in pairs]
    return ms[0], ls[0]


def tiles(vocab_size):
    return [(lo, min(lo + VOCAB_TILE, vocab_size)) for lo in range(0, vocab_size, VOCAB_TILE)]


def tile_logits(h32, weight, lo, hi, temperature, prims: Prims = REFERENCE):
    """float32 logits / temperature for vocab rows [lo, hi)."""
    return prims.matmul(h32, weight[lo:hi].t()) / temperature


def tile_stats(h32, weight, targets, lo, hi, temperature, prims: Prims = REFERENCE):
    """(m, l, z_target or 0, owns_target) for one vocab tile."""
    z = tile_logits(h32, weight, lo, hi, temperature, prims)
    m = z.amax(dim=-1)
    l = tree_sum(prims.exp(z - m[:, None]), dim=-1)
    own = (targets >= lo) & (targets < hi)
    idx = (targets - lo).clamp(0, hi - lo - 1)
    zt = torch.where(own, z.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
    return m, l, zt, own


def targets_lse(hidden, weight, targets, temperature, vocab_size, prims: Prims = REFERENCE):
    """(logprob of targets [T], lse [T]), float32: the composition."""
    h32 = hidden.float()
    ms, ls = [], []
    zt = torch.zeros(h32.shape[0], device=h32.device)
    for lo, hi in tiles(vocab_size):
        m, l, z, own = tile_stats(h32, weight, targets, lo, hi, temperature, prims)
        ms.append(m)
        ls.append(l)
        zt = torch.where(own, z, zt)
    m, l = tree_merge_ml(ms, ls, prims)
    log_l = prims.log(l)
    return (zt - m) - log_l, m + log_l


def lse(hidden, weight, temperature, vocab_size, prims: Prims = REFERENCE):
    h32 = hidden.float()
    ms, ls = [], []
    for lo, hi in tiles(vocab_size):
        z = tile_logits(h32, weight, lo, hi, temperature, prims)
        m = z.amax(dim=-1)
        ms.append(m)
        ls.append(tree_sum(prims.exp(z - m[:, None]), dim=-1))
    m, l = tree_merge_ml(ms, ls, prims)
    return m + prims.log(l)


def full(hidden, weight, temperature, vocab_size, prims: Prims = REFERENCE):
    """Every vocab entry's logprob, each bitwise equal to the targeted op's value for it:
    the same tile GEMMs, the same (m, l) tree, the same final formula."""
    h32 = hidden.float()
    zs, ms, ls = [], [], []
    for lo, hi in tiles(vocab_size):
        z = tile_logits(h32, weight, lo, hi, temperature, prims)
        m = z.amax(dim=-1)
        zs.append(z)
        ms.append(m)
        ls.append(tree_sum(prims.exp(z - m[:, None]), dim=-1))
    m, l = tree_merge_ml(ms, ls, prims)
    log_l = prims.log(l)
    return torch.cat([(z - m[:, None]) - log_l[:, None] for z in zs], dim=-1)


def tiled_backward(hidden, weight, temperature, vocab_size, grad_z, needs, prims: Prims):
    """Gradients of hidden and weight from dL/dz, one vocab tile at a time in fixed order
    (the tile's logits recomputed, never stored); dz/dlogits = 1/T. dL/dhidden is summed over
    tiles left to right; each tile's share is a contract GEMM over its vocab rows."""
    h32 = hidden.float()
    gh = torch.zeros_like(h32) if needs[0] else None
    gw = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
    for lo, hi in tiles(vocab_size):
        gz = grad_z(tile_logits(h32, weight, lo, hi, temperature, prims), lo, hi) / temperature
        if gh is not None:
            gh = gh + prims.matmul(gz, weight[lo:hi])
        if gw is not None:
            gw[lo:hi] = prims.matmul(gz.t(), h32)
    return (gh.to(hidden.dtype) if gh is not None else None, gw.to(weight.dtype) if gw is not None else None)


def logprob_grad_z(lse_, targets, g, prims: Prims):
    """d lp / d z_j = onehot_j - softmax_j, times the incoming gradient, for one tile."""
    def grad_z(z, lo, hi):
        gz = -prims.exp(z - lse_[:, None])
        own = (targets >= lo) & (targets < hi)
        rows = own.nonzero()[:, 0]
        gz[rows, targets[rows] - lo] += 1.0
        return gz * g[:, None]
    return grad_z


class LogprobFn(torch.autograd.Function):
    """Forward bits from `fwd` ((lp, lse) from a kernel or `targets_lse`); tiled shared backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size, fwd, prims):
        lp, lse_ = fwd(hidden, weight, targets, temperature, vocab_size)
        ctx.save_for_backward(hidden, weight, targets, lse_)
        ctx.temperature, ctx.vocab_size, ctx.prims = temperature, vocab_size, prims
        return lp

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets, lse_ = ctx.saved_tensors
        grad_z = logprob_grad_z(lse_, targets, g.float(), ctx.prims)
        gh, gw = tiled_backward(hidden, weight, ctx.temperature, ctx.vocab_size, grad_z, ctx.needs_input_grad[:2], ctx.prims)
        return gh, gw, None, None, None, None, None


class EntropyFn(torch.autograd.Function):
    """H = lse - sum_j p_j z_j over the true vocab, tile by tile (never the whole logits);
    dH/dz_j = -p_j (z_j - sum_i p_i z_i)."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, vocab_size, lse_fn, prims):
        h32 = hidden.float()
        lse_ = lse_fn(hidden, weight, temperature, vocab_size)
        parts = [tree_sum(prims.exp(z - lse_[:, None]) * z, dim=-1)
                 for z in (tile_logits(h32, weight, lo, hi, temperature, prims) for lo, hi in tiles(vocab_size))]
        mean_z = tree_sum(torch.stack(parts, dim=-1), dim=-1)
        ctx.save_for_backward(hidden, weight, lse_, mean_z)
        ctx.temperature, ctx.vocab_size, ctx.prims = temperature, vocab_size, prims
        return lse_ - mean_z

    @staticmethod
    def backward(ctx, g):
        hidden, weight, lse_, mean_z = ctx.saved_tensors
        g, prims = g.float(), ctx.prims

        def grad_z(z, lo, hi):
            return -prims.exp(z - lse_[:, None]) * (z - mean_z[:, None]) * g[:, None]

        gh, gw = tiled_backward(hidden, weight, ctx.temperature, ctx.vocab_size, grad_z, ctx.needs_input_grad[:2], prims)
        return gh, gw, None, None, None, None


def linear_logprob(kind, hidden, weight, targets, temperature, vocab_size, *, prims: Prims = REFERENCE,
                   fwd_targets_lse=None, fwd_lse=None, fwd_full=None):
    """The op for one implementation; `fwd_*` are its forward kernels (default: the composition)."""
    fwd_targets_lse = fwd_targets_lse or (lambda *a: targets_lse(*a, prims=prims))
    fwd_lse = fwd_lse or (lambda *a: lse(*a, prims=prims))
    if kind == "full":
        return (fwd_full or (lambda *a: full(*a, prims=prims)))(hidden, weight, temperature, vocab_size)
    if kind == "entropy":
        return EntropyFn.apply(hidden, weight, temperature, vocab_size, fwd_lse, prims)
    if wants_grad(hidden, weight):
        return LogprobFn.apply(hidden, weight, targets, temperature, vocab_size, fwd_targets_lse, prims)
    return fwd_targets_lse(hidden, weight, targets, temperature, vocab_size)[0]
