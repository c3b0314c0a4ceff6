"""Token-segmented weight gradients: a backward whose bits do not depend on the context-parallel size
(contract: rlkernel.contracts.collectives.TOKEN_SEGMENTS_BACKWARD).

What this module decides: how a strict update sums over tokens. Context parallelism gives each CP
rank a contiguous slice of the packed stream, so every sum over tokens in the backward — a weight
gradient (X^T dY of each linear, the norms' weights, the embedding rows, the lm head) and the
keys' and values' gradients in attention (a sum over the queries that see them) — becomes one
partial per rank merged across ranks: a different order at every CP size. Here the stream is cut
into S canonical token segments (S a power of two, fixed by the run: `trainer.token_segments`),
each rank holding S / CP of them, and every such sum is computed one segment at a time — the same
computation on the same tokens whatever the layout — kept in float32 as one partial per segment,
and merged by the canonical tree: first over the rank's own segments, then over the ranks (an
aligned subtree: the same tree). A CP=1 run with the same S runs the same segments, so CP=1, 2, 4,
... give the same gradients bit for bit. Per-token results (dX, dQ, a norm's dX) are untouched:
each row's computation never depends on the other rows.

Parameters receive their token-summed gradients here, not through autograd: the strict functions
deposit their per-segment float32 partials ([n_local, *shape]) on the parameter
(`deposit`), and `finalize` merges them after the backward and sets `p.grad` (one cast). A weight
used twice (an embedding tied to the lm head) gets the sum of both uses per segment before the
tree, so the tie does not change the order either. Off (no `segments(...)` block): nothing changes.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..backends.reference.primitives import tree_sum
from .collectives import tree_all_reduce


@dataclass(frozen=True)
class State:
    n_local: int  # canonical token segments on this rank (S / CP)
    row_splits: tuple[int, ...] | None = None  # scored rows per local segment (the logprob head's rows, in order)


_STATE: contextvars.ContextVar = contextvars.ContextVar("rlkernel_token_segments", default=None)


@contextlib.contextmanager
def segments(n_local: int, row_splits: Sequence[int] | None = None) -> Iterator[State]:
    """Within the block, the strict functions whose forward runs there compute their token sums per segment (this
    rank's `n_local` equal, contiguous slices of its tokens) and deposit them on the parameters. `row_splits`: how
    many of the rows fed to the logprob head fall in each local segment."""
    if n_local < 1:
        raise ValueError(f"token segments: n_local must be >= 1, got {n_local}")
    if row_splits is not None and len(row_splits) != n_local:
        raise ValueError(f"token segments: {len(row_splits)} row splits for {n_local} segments")
    state = State(n_local, None if row_splits is None else tuple(int(r) for r in row_splits))
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


def current() -> State | None:
    """The state in effect (captured by a function's forward: backwards may run on another thread)."""
    return _STATE.get()


def split(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """x's rows in n equal contiguous slices (the local token segments)."""
    if x.shape[0] % n:
        raise ValueError(f"token segments: {x.shape[0]} rows do not split into {n} equal segments (pad the stream to a multiple of S)")
    return list(x.split(x.shape[0] // n))


def deposit(param: torch.Tensor, parts: torch.Tensor) -> None:
    """Add one use's per-segment float32 partials [n_local, *param.shape] to `param`'s pending gradient."""
    parts = parts.float()
    if parts.shape[1:] != param.shape:
        raise ValueError(f"token segments: partials {tuple(parts.shape)} for a parameter of shape {tuple(param.shape)}")
    pending = getattr(param, "rk_token_grad", None)
    if pending is None:
        param.rk_token_grad = parts.contiguous()
    else:
        pending.add_(parts)  # per segment: the second use's partial after the first (the same order at any CP size)


def weight_reducer(param: torch.Tensor, state: State, base=None):
    """A norm's weight-gradient reducer (backends.reference.norm.weight_grad_reducer) under token segments: the rows of
    each local segment reduced alone (by `base`, e.g. the q/k norm's head-segment trees, else the tree over the rows),
    deposited on `param` in float32; the norm's backward then returns no weight gradient."""
    one = base if base is not None else (lambda r: tree_sum(r, dim=0))

    def reduce(rows: torch.Tensor) -> None:
        deposit(param, torch.stack([one(r).float() for r in split(rows, state.n_local)]))
        return None

    return reduce


def pending(params) -> list[torch.Tensor]:
    return [p for p in params if getattr(p, "rk_token_grad", None) is not None]


def finalize(params, group=None) -> list[torch.Tensor]:
    """Merge every pending gradient: the tree over this rank's segments, the tree over the CP `group`'s ranks (float32
    throughout), one cast to the parameter's dtype, into p.grad (added to a gradient autograd left there, e.g. none).
    Returns the parameters it set."""
    done = []
    for p in pending(params):
        local = tree_sum(p.rk_token_grad, dim=0)
        total = tree_all_reduce([local], group, check=False) if group is not None and group.size() > 1 else local
        g = total.to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g
        del p.rk_token_grad
        done.append(p)
    return done


def clear(params) -> None:
    """Drop pending gradients (an update that raised before its step)."""
    for p in pending(params):
        del p.rk_token_grad


class EmbeddingFn(torch.autograd.Function):
    """weight[ids] (an exact gather); backward: per local token segment the rows' gradients summed per id by
    index_put_ with accumulate (deterministic: a function of the segment's ids and gradients alone), deposited."""

    @staticmethod
    def forward(ctx, weight, ids, state: State):
        ctx.save_for_backward(ids)
        ctx.param, ctx.state = weight, state
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        w = ctx.param
        parts = []
        for ids_s, g_s in zip(split(ids, ctx.state.n_local), split(g.float(), ctx.state.n_local)):
            parts.append(torch.zeros(w.shape, dtype=torch.float32, device=g.device).index_put_((ids_s,), g_s, accumulate=True))
        deposit(w, torch.stack(parts))
        return None, None, None


def embedding(weight: torch.Tensor, ids: torch.Tensor, vocab_start: int = 0, group=None) -> torch.Tensor:
    """Token-segmented lookup of ids [T] in a vocab-parallel shard (rows [vocab_start, vocab_start + shard)); the
    ranks' rows merged over `group` (exact: one rank holds each id)."""
    state = current()
    if state is None:
        raise RuntimeError("token_segments.embedding: only inside a segments(...) block")
    shard = weight.shape[0]
    local = (ids >= vocab_start) & (ids < vocab_start + shard)
    rows = torch.where(local, ids - vocab_start, torch.zeros_like(ids))
    out = EmbeddingFn.apply(weight, rows, state) * local[:, None].to(weight.dtype)
    if group is not None and group.size() > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        out = reduce_from_tensor_model_parallel_region(out, group=group)
    return out
