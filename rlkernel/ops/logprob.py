"""Linear-logprob: hidden x lm_head -> float32 logprob of chosen tokens.

Strict contract: the true vocab [0, vocab_size) is cut into tiles of VOCAB_TILE
rows of the lm_head (padding rows are never read); each tile's logits are one
row-invariant fp32 GEMM, divided by the temperature, reduced to a per-tile
(m, l) with l a balanced tree of position-independent exps; the tiles' (m, l)
are merged by one balanced binary tree over tile index (identity-padded to a
power of two — the same tree a vocab-parallel group reproduces, rank blocks
being its subtrees); logprob = (z_target - m) - log(l). Only one tile of logits
exists at a time, forward and backward (the backward recomputes each tile).

`tile_stats` / `merge_ml` are public so the vocab-parallel collective reuses
exactly these pieces.
"""
from __future__ import annotations

import math

import torch

from .. import dispatch, fused
from ..contract import Contract
from ..primitives import strict_exp, strict_log, tile_matmul, tree_sum

VOCAB_TILE = 512

REFERENCE = Contract(
    op="linear_logprob",
    backend="reference",
    domain="vocab [0, vocab_size)",
    partition=(("vocab_tile", VOCAB_TILE), ("m_tile", 16), ("padding_rows", "excluded")),
    merge="per tile: m = max, l = balanced tree of exp(z - m); across tiles: balanced binary tree over tile index",
    precision=(("hidden,weight", "widened to float32"), ("logits", "float32"), ("m,l", "float32"), ("output", "float32")),
    rounding=("z = (h.w) / temperature", "lp = (z_t - m) - log(l)"),
    primitives=(("exp", "Cody-Waite + degree-7 Horner, fp32"), ("log", "exponent split + atanh series, fp32")),
    invariant=("batch", "row position", "threads 1 vs 2", "run to run"),
)
NATIVE = Contract(
    op="linear_logprob",
    backend="native",
    domain="vocab [0, vocab_size)",
    partition=(("vocab_tile", "whole vocab"),),
    merge="torch log_softmax over full float32 logits",
    precision=(("logits", "hidden dtype, then float32"), ("output", "float32")),
    rounding=("logits rounded to hidden dtype by F.linear", "logits.float() / temperature"),
    primitives=(("exp/log", "library"),),
)


def merge_ml(m1, l1, m2, l2):
    """Merge two (max, sum-of-exp) pairs; (-inf, 0) is an exact identity."""
    m = torch.maximum(m1, m2)
    safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    return m, l1 * strict_exp(m1 - safe) + l2 * strict_exp(m2 - safe)


def tree_merge_ml(ms: list, ls: list):
    """Balanced binary tree over a list of (m, l), identity-padded to a power of two."""
    n = len(ms)
    p = 1 << max(n - 1, 0).bit_length()
    ms = list(ms) + [torch.full_like(ms[0], -math.inf)] * (p - n)
    ls = list(ls) + [torch.zeros_like(ls[0])] * (p - n)
    while len(ms) > 1:
        pairs = [merge_ml(ms[i], ls[i], ms[i + 1], ls[i + 1]) for i in range(0, len(ms), 2)]
        ms, ls = [a for a, _ in pairs], [b for _, b in pairs]
    return ms[0], ls[0]


def tile_logits(h32, weight, lo, hi, temperature):
    """float32 logits / temperature for vocab rows [lo, hi)."""
    return tile_matmul(h32, weight[lo:hi].float().t()) / temperature


def tile_stats(h32, weight, targets, lo, hi, temperature):
    """(m, l, z_target or 0, owns_target) for one vocab tile."""
    z = tile_logits(h32, weight, lo, hi, temperature)
    m = z.amax(dim=-1)
    l = tree_sum(strict_exp(z - m[:, None]), dim=-1)
    own = (targets >= lo) & (targets < hi)
    idx = (targets - lo).clamp(0, hi - lo - 1)
    zt = torch.where(own, z.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
    return m, l, zt, own


def _tiles(vocab_size):
    return [(lo, min(lo + VOCAB_TILE, vocab_size)) for lo in range(0, vocab_size, VOCAB_TILE)]


def _forward(h32, weight, targets, temperature, vocab_size):
    ms, ls = [], []
    zt = torch.zeros(h32.shape[0], device=h32.device)
    for lo, hi in _tiles(vocab_size):
        m, l, z, own = tile_stats(h32, weight, targets, lo, hi, temperature)
        ms.append(m)
        ls.append(l)
        zt = torch.where(own, z, zt)
    m, l = tree_merge_ml(ms, ls)
    return (zt - m) - strict_log(l), m, l


def _tiled_backward(ctx, hidden, weight, grad_z):
    """Gradients of hidden and weight from dL/dz, one vocab tile at a time in fixed order
    (a deterministic sum; the tile's logits are recomputed, never stored). dz/dlogits = 1/T."""
    t, h32 = ctx.temperature, hidden.float()
    gh = torch.zeros_like(h32) if ctx.needs_input_grad[0] else None
    gw = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
    for lo, hi in _tiles(ctx.vocab_size):
        gz = grad_z(tile_logits(h32, weight, lo, hi, t), lo, hi) / t
        if gh is not None:
            gh = gh + tile_matmul(gz, weight[lo:hi].float())
        if gw is not None:
            gw[lo:hi] = tile_matmul(gz.t(), h32)
    return (gh.to(hidden.dtype) if gh is not None else None, gw.to(weight.dtype) if gw is not None else None)


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size):
        if fused.route(hidden, weight) is not None:  # the same bits in one fused pass
            lp, lse = fused.ops().logprob_targets_lse(hidden, weight, targets, temperature, vocab_size, _plain(hidden, vocab_size))
        else:
            lp, m, l = _forward(hidden.float(), weight, targets, temperature, vocab_size)
            lse = m + strict_log(l)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.vocab_size = temperature, vocab_size
        return lp

    @staticmethod
    def backward(ctx, g):
        hidden, weight, targets, lse = ctx.saved_tensors
        g = g.float()

        def grad_z(z, lo, hi):
            # d lp / d z_j = onehot_j - softmax_j
            gz = -strict_exp(z - lse[:, None])
            own = (targets >= lo) & (targets < hi)
            rows = own.nonzero()[:, 0]
            gz[rows, targets[rows] - lo] += 1.0
            return gz * g[:, None]

        return (*_tiled_backward(ctx, hidden, weight, grad_z), None, None, None)


def _tile_ml(h32, weight, temperature, vocab_size, keep_logits=True):
    """Per tile: max m and l = tree sum of exp(z - m), and (keep_logits) its logits z —
    shared by the full table and the lse (which keeps one tile of logits at a time)."""
    zs, ms, ls = [], [], []
    for lo, hi in _tiles(vocab_size):
        z = tile_logits(h32, weight, lo, hi, temperature)
        m = z.amax(dim=-1)
        if keep_logits:
            zs.append(z)
        ms.append(m)
        ls.append(tree_sum(strict_exp(z - m[:, None]), dim=-1))
    return zs, ms, ls


def _full(h32, weight, temperature, vocab_size):
    """Every vocab entry's logprob, each bitwise equal to the targeted op's value for it:
    the same tile GEMMs, the same (m, l) tree, the same final formula."""
    zs, ms, ls = _tile_ml(h32, weight, temperature, vocab_size)
    m, l = tree_merge_ml(ms, ls)
    log_l = strict_log(l)
    return torch.cat([(z - m[:, None]) - log_l[:, None] for z in zs], dim=-1)


def _plain(hidden, vocab_size):
    """Whether the fused kernel may run the vocab tiles as plain GEMMs (see fused.plain_gemm_ok)."""
    h, last = hidden.shape[1], vocab_size % VOCAB_TILE
    return fused.plain_gemm_ok(h, min(VOCAB_TILE, vocab_size)) and (last == 0 or fused.plain_gemm_ok(h, last))


def _lse(h32, weight, temperature, vocab_size):
    if fused.route(h32, weight) is not None:
        return fused.ops().logsumexp(h32, weight, temperature, vocab_size, _plain(h32, vocab_size))
    _, ms, ls = _tile_ml(h32, weight, temperature, vocab_size, keep_logits=False)
    m, l = tree_merge_ml(ms, ls)
    return m + strict_log(l)


class _LinearEntropy(torch.autograd.Function):
    """H = lse - sum_j p_j z_j over the true vocab, tile by tile (never the whole logits);
    dH/dz_j = -p_j (z_j - sum_i p_i z_i)."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature, vocab_size):
        h32 = hidden.float()
        lse = _lse(h32, weight, temperature, vocab_size)
        parts = [tree_sum(strict_exp(z - lse[:, None]) * z, dim=-1)
                 for z in (tile_logits(h32, weight, lo, hi, temperature) for lo, hi in _tiles(vocab_size))]
        mean_z = tree_sum(torch.stack(parts, dim=-1), dim=-1)
        ctx.save_for_backward(hidden, weight, lse, mean_z)
        ctx.temperature, ctx.vocab_size = temperature, vocab_size
        return lse - mean_z

    @staticmethod
    def backward(ctx, g):
        hidden, weight, lse, mean_z = ctx.saved_tensors
        g = g.float()

        def grad_z(z, lo, hi):
            return -strict_exp(z - lse[:, None]) * (z - mean_z[:, None]) * g[:, None]

        return (*_tiled_backward(ctx, hidden, weight, grad_z), None, None)


@dispatch.register("linear_logprob", "reference", REFERENCE)
def _linear_logprob_reference(kind, hidden, weight, targets, temperature, vocab_size):
    if kind != "entropy" and fused.active(hidden, weight):
        plain = _plain(hidden, vocab_size)
        if kind == "full":  # plain: every tile from one GEMM over the whole vocab, so check that shape too
            plain = plain and fused.plain_gemm_ok(hidden.shape[1], vocab_size)
            return fused.ops().logprobs_full(hidden, weight, temperature, vocab_size, plain)
        return fused.ops().logprob_targets(hidden, weight, targets, temperature, vocab_size, plain)
    if kind == "full":
        return _full(hidden.float(), weight, temperature, vocab_size)
    if kind == "entropy":
        return _LinearEntropy.apply(hidden, weight, temperature, vocab_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearLogprob.apply(hidden, weight, targets, temperature, vocab_size)
    return _forward(hidden.float(), weight, targets, temperature, vocab_size)[0]


@dispatch.register("linear_logprob", "native", NATIVE)
def _linear_logprob_native(kind, hidden, weight, targets, temperature, vocab_size):
    logits = torch.nn.functional.linear(hidden, weight[:vocab_size]).float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    if kind == "entropy":
        return -(lp.exp() * lp).sum(-1)
    return lp if kind == "full" else lp.gather(1, targets[:, None])[:, 0]


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, vocab_size: int | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 log p(targets) under softmax(hidden @ weight[:vocab_size].T / temperature).

    hidden [T, H]; weight [V_padded, H]; targets [T] int64 in [0, vocab_size).
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprob: want hidden [T, H] and targets [T]; got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    if not 0 < vocab_size <= weight.shape[0] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"linear_logprob: weight {tuple(weight.shape)} does not fit hidden {hidden.shape[1]} / vocab_size {vocab_size}")
    if not temperature > 0:
        raise ValueError(f"linear_logprob: temperature must be > 0, got {temperature}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"linear_logprob: targets outside [0, {vocab_size})")
    return dispatch.call("linear_logprob", backend, (hidden, weight, targets), "targets", hidden, weight, targets.long(), float(temperature), vocab_size)


def linear_logprobs_full(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0, *, vocab_size: int | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 [T, vocab_size] log-softmax of hidden @ weight[:vocab_size].T / temperature.

    Element [t, v] is bitwise equal to `linear_logprob(hidden, weight, targets)` at row t with
    targets[t] = v: a rollout engine that samples from this table reports exactly the value the
    trainer recomputes. Materialises the whole table: for sampling, not for training.
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if hidden.dim() != 2 or weight.shape[1] != hidden.shape[1] or not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_logprobs_full: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, vocab_size {vocab_size}")
    if not temperature > 0:
        raise ValueError(f"linear_logprobs_full: temperature must be > 0, got {temperature}")
    return dispatch.call("linear_logprob", backend, (hidden, weight), "full", hidden, weight, None, float(temperature), vocab_size)


def linear_entropy(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0, *, vocab_size: int | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 [T] entropy of softmax(hidden @ weight[:vocab_size].T / temperature), differentiable,
    computed tile by tile under the linear-logprob contract (for the GRPO entropy bonus and metrics)."""
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if hidden.dim() != 2 or weight.shape[1] != hidden.shape[1] or not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, vocab_size {vocab_size}")
    return dispatch.call("linear_logprob", backend, (hidden, weight), "entropy", hidden, weight, None, float(temperature), vocab_size)
