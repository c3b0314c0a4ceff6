"""Tensor-parallel backwards whose bits do not depend on the TP size (contract: TP_BACKWARD_REFERENCE).

What this module decides: how the gradients TP splits into per-rank partial sums are merged.
The forward of a TP layer stack is already TP invariant (column shards are column invariant,
row-parallel GEMMs reduce over canonical K-segments, the vocab-parallel logprob over the tile
tree). Its backward is not, unless every partial sum is one of S canonical segments fixed by
the model and merged by one tree: then TP=1 (all S segments local) and TP=w (S/w each) give
the same bits. Three sums need it — the input gradient of a column-parallel linear (sum over
its output rows), the input gradient of the vocab-parallel logprob (sum over vocab tiles),
the weight gradient of a norm shared by all heads (sum over heads) — plus the global grad
norm (a sum over every parameter's shards). Everything else in the backward is local to a
rank or the same on every rank.
"""
from __future__ import annotations

import functools

import torch

from .. import dispatch
from ..backends.reference.primitives import tree_sum
from ..ops.linear import linear, linear_segment_partials
from . import token_segments as _ts
from .collectives import _gather, _tree_reduce, tree_all_reduce


def segment_rows(rows: int, stride: int, segments: int) -> list[torch.Tensor]:
    """Row indices of each of `segments` canonical segments of a [rows, ...] shard laid out with Megatron's
    partition `stride` (e.g. fc1's [gate; up]): segment j = chunk j of every stride block."""
    if rows % (stride * segments):
        raise ValueError(f"{rows} rows do not split into stride {stride} x {segments} segments")
    c = rows // (stride * segments)
    return [torch.cat([torch.arange((t * segments + j) * c, (t * segments + j + 1) * c) for t in range(stride)]) for j in range(segments)]


@functools.lru_cache(maxsize=256)
def _segment_perm(rows: int, stride: int, segments: int, device: torch.device) -> torch.Tensor | None:
    """The rows of every canonical segment in segment order, on `device` (None when that is the identity: stride 1)."""
    if stride == 1:
        if rows % segments:
            raise ValueError(f"{rows} rows do not split into stride 1 x {segments} segments")
        return None
    return torch.cat(segment_rows(rows, stride, segments)).to(device)


def _one_rank(group) -> bool:
    """A group of one rank (or none): every canonical segment is local, so the tree over them is the whole tree and
    `linear(..., k_segments=S)` (the contract's k-segment GEMM: the per-segment partials merged by the same tree, then
    one cast) gives tree_all_reduce's bits in one call, without S partial buffers (tests/test_megatron_tp.py)."""
    return group is None or group.size() == 1


class ColumnParallelLinearFn(torch.autograd.Function):
    """y = linear(x, w_local, b_local) (strict). Backward: dX as the canonical tree over the output-row segments of
    every rank (a partial dY_s @ W_s per segment), dW = dY^T X and db = sum_T dY locally (the same rows at any TP)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, segments: int, stride: int):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.segments, ctx.stride, ctx.has_bias = group, segments, stride, bias is not None
        ctx.tokens, ctx.param = _ts.current(), weight  # token-segmented weight gradient (token_segments.py), or None
        if ctx.tokens is not None and bias is not None:
            raise NotImplementedError("token-segmented backward: a linear with a bias (no Qwen3/Llama layer has one)")
        return linear(x, weight, bias, backend="strict")

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]).to(x.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            perm = _segment_perm(weight.shape[0], ctx.stride, ctx.segments, x.device)
            dy_s, w_s = (dy2, weight) if perm is None else (dy2[:, perm], weight[perm])
            if _one_rank(ctx.group):  # the tree over this rank's segments is the whole tree: linear's k-segment GEMM
                dx = linear(dy_s, w_s.t(), k_segments=ctx.segments, backend="strict").reshape(x.shape)
            else:
                parts = linear_segment_partials(dy_s, w_s.t().contiguous(), ctx.segments)  # [M, K] float32 each
                dx = tree_all_reduce(parts, ctx.group, check=False).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1] and ctx.tokens is not None:
            _ts.deposit(ctx.param, _segment_weight_grads(dy2, x2, ctx.tokens.n_local))
        elif ctx.needs_input_grad[1]:
            dw = linear(dy2.t().contiguous(), x2.t().contiguous(), backend="strict").to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = tree_sum(dy2.float(), dim=0).to(weight.dtype)
        return dx, dw, db, None, None, None


class RowParallelLinearFn(torch.autograd.Function):
    """y = the canonical tree over every rank's K-segment partials of x_local @ w_local^T (float32, the forward of
    `linear_segment_partials` + `tree_all_reduce`; at one rank `linear` with k_segments, already cast to x's dtype).
    Backward in two GEMMs with the bits of differentiating each partial on its own: dX = g @ W_local (a column's sum
    over N does not depend on the other columns: the GEMM is column invariant) and dW = (X^T g)^T (a row's likewise:
    row invariant), each under the strict implementation's matmul, as the per-segment GEMMs were; one autograd node
    instead of a slice, a GEMM pair and a cast per segment. (Equal values; only an exact zero's sign can differ from
    the per-segment graph, which added every other segment's zero gradient to each slice: -0.0 + 0.0 = +0.0.)"""

    @staticmethod
    def forward(ctx, x, weight, group, segments: int):
        impl = dispatch.resolve("linear", x.device, "strict")
        ctx.save_for_backward(x, weight)
        ctx.prims = impl.prims
        ctx.tokens, ctx.param = _ts.current(), weight
        if _one_rank(group):  # linear with k_segments is the canonical tree over the segment partials, cast once
            return linear(x, weight, k_segments=segments, backend="strict")
        return tree_all_reduce(linear_segment_partials(x, weight, segments), group, check=False)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.float()  # one rank returns x's dtype (the cast's backward would hand float32 back): float32 GEMMs either way
        mm, x2 = ctx.prims.matmul, x.reshape(-1, x.shape[-1])
        dx = mm(g, weight).to(x.dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1] and ctx.tokens is not None:
            _ts.deposit(ctx.param, _segment_weight_grads(g, x2, ctx.tokens.n_local))
        elif ctx.needs_input_grad[1]:
            dw = mm(x2.t(), g).to(weight.dtype).t()
        return dx, dw, None, None


def _segment_weight_grads(dy: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """[n, N, K] float32: dY_s^T X_s of each of n token segments (rows of dy [T, N] and x [T, K]), each one GEMM of the
    strict implementation over the segment's tokens alone (the same computation at any CP size)."""
    mm = dispatch.resolve("linear", x.device, "strict").prims.matmul
    return torch.stack([mm(d.t().to(xs.dtype), xs) for d, xs in zip(_ts.split(dy, n), _ts.split(x, n))])  # dY in X's dtype


def head_segment_weight_grad(heads: int, n: int, group, dtype: torch.dtype):
    """The weight-gradient reducer (backends.reference.norm.weight_grad_reducer) of a norm weight shared by `heads`
    local heads in `n` canonical segments: rows [tokens * heads, D] in (token, head) order -> each segment's tree over
    its rows cast to `dtype`, then the tree over every rank's segments — the adds of one norm call per segment whose
    weight gradients the tree merges, so every rank holds the full, TP-invariant gradient in one call."""
    if heads % n:
        raise ValueError(f"{heads} heads do not split into {n} canonical segments")

    def reduce(rows: torch.Tensor) -> torch.Tensor:
        d = rows.shape[-1]
        # [tokens * heads_in_segment, n * d]: segment j's rows in (token, head) order under columns j*d..(j+1)*d, one copy;
        # the tree over the rows is then each segment's tree over its own rows
        segs = rows.view(-1, n, heads // n, d).permute(0, 2, 1, 3).reshape(-1, n * d)
        sums = tree_sum(segs, dim=0).view(n, d).to(dtype)
        if _one_rank(group):  # tree_all_reduce's own merge (float32 tree, one cast) without the list round trip
            return _tree_reduce(sums)
        return tree_all_reduce(list(sums.unbind(0)), group, check=False)

    return reduce


def _chunk_square_sums(stacked: torch.Tensor, spec) -> torch.Tensor:
    """[c, n] float32: for each of c gradients stacked [c, *shape] of one ("chunks", dim, stride, n) parameter, the tree
    sum of squares of each of its n local canonical segments (segment j = chunk j of every stride block, as
    segment_rows, its elements in that order; a tree per row of the stack is that gradient's tree alone)."""
    _, dim, stride, n = spec
    g = stacked.movedim(dim + 1, 1)
    if g.shape[1] % (stride * n):
        raise ValueError(f"{g.shape[1]} rows do not split into stride {stride} x {n} segments")
    c = g.shape[0]
    return tree_sum(g.float().square().reshape(c, stride, n, -1).transpose(1, 2).reshape(c, n, -1), dim=-1)


def _segment_values(grad: torch.Tensor, spec) -> list[torch.Tensor]:
    """Sum of squares (float32, tree) of each local canonical segment of a sharded gradient."""
    kind = spec[0]
    if kind == "chunks":  # ("chunks", dim, stride, n_local)
        return list(_chunk_square_sums(grad[None], spec)[0].unbind(0))
    if kind == "rows":  # ("rows", rows_per_segment, n_local): vocab segments (the last ones may be short or empty)
        _, per, n = spec
        return [tree_sum(grad[j * per:(j + 1) * per].float().square().reshape(-1), dim=0) for j in range(n)]
    raise ValueError(f"unknown segment spec {spec!r}")


def canonical_grad_norm(named_params, group, grad=None) -> torch.Tensor:
    """sqrt of the sum of squares of every gradient, TP invariant: a parameter tagged `rk_segments` (sharded) contributes
    the tree over all ranks' canonical segments (gathered in rank order), any other (replicated) its own tree sum; then
    one tree over the parameters in named order. `grad(p)`: where a parameter's gradient lives (default p.grad; Megatron
    DDP keeps it in p.main_grad).

    Parameters of one shape, dtype and spec (a layer stack's q_proj, fc1, ...) are computed together: their gradients
    stacked, each one's trees over its own row of the stack (a tree per row is the tree of that row alone), one gather
    per group across the TP ranks — a few launches per kind of parameter instead of several per parameter
    (`canonical_grad_norm_per_param` is the definition; tests/test_collectives.py compares them bit for bit)."""
    entries = []
    for _, p in named_params:
        g = p.grad if grad is None else grad(p)
        if g is not None:
            entries.append((g, getattr(p, "rk_segments", None)))
    if not entries:
        return torch.zeros(())
    groups: dict[tuple, list[int]] = {}
    for i, (g, spec) in enumerate(entries):
        kind = spec if spec is None or spec[0] == "chunks" else ("single", i)  # "rows" specs (vocab) stay one by one
        groups.setdefault((tuple(g.shape), g.dtype, g.device, kind), []).append(i)
    values: list[torch.Tensor | None] = [None] * len(entries)
    for (_, _, _, kind), idxs in groups.items():
        per = max(1, _STACK_ELEMENTS // max(1, entries[idxs[0]][0].numel()))
        for c0 in range(0, len(idxs), per):
            part = idxs[c0:c0 + per]
            if kind is not None and kind[0] == "single":
                (i,) = part
                values[i] = _param_value(entries[i][0], entries[i][1], group)
                continue
            stacked = torch.stack([entries[i][0] for i in part])
            if kind is None:
                vals = tree_sum(stacked.float().square().reshape(len(part), -1), dim=-1)
            else:
                local = _chunk_square_sums(stacked, kind)  # [c, n]: each parameter's local segments
                # every rank's segments of one parameter in rank order (rank-major)
                every = local if _one_rank(group) else _gather(local, group).transpose(0, 1).reshape(len(part), -1)
                vals = tree_sum(every, dim=-1)
            for j, i in enumerate(part):
                values[i] = vals[j]
    return torch.sqrt(tree_sum(torch.stack(values), dim=0))


_STACK_ELEMENTS = 1 << 26  # gradient elements stacked at once (256 MiB in float32): how many run together, never bits


def _param_value(g: torch.Tensor, spec, group) -> torch.Tensor:
    """One parameter's contribution: its tree sum of squares, or the tree over every rank's canonical segments."""
    if spec is None:
        return tree_sum(g.float().square().reshape(-1), dim=0)
    local = torch.stack(_segment_values(g, spec))
    every = local if _one_rank(group) else _gather(local, group).reshape(-1)
    return tree_sum(every, dim=0)


def canonical_grad_norm_per_param(named_params, group, grad=None) -> torch.Tensor:
    """`canonical_grad_norm`'s definition, one parameter at a time (tests compare the grouped one with it)."""
    values = []
    for _, p in named_params:
        g = p.grad if grad is None else grad(p)
        if g is not None:
            values.append(_param_value(g, getattr(p, "rk_segments", None), group))
    if not values:
        return torch.zeros(())
    return torch.sqrt(tree_sum(torch.stack(values), dim=0))
