"""RMSNorm under the strict contract (contracts/norm.py): composition and shared explicit backward."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

from .linear import wants_grad
from .primitives import strict_rsqrt, tree_sum

_WEIGHT_GRAD: contextvars.ContextVar = contextvars.ContextVar("rlkernel_rms_weight_grad", default=None)


@contextlib.contextmanager
def weight_grad_reducer(fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """For the strict rms_norm calls whose forward runs in this block: the weight gradient is fn(rows) — rows the
    [R, H] float32 per-row products the backward sums, in row order — instead of their tree over all rows cast to the
    weight's dtype. StrictHeadRMSNorm uses it to sum a q/k norm weight shared by every head per canonical head segment
    in one call (same adds as one call per segment); under token segments the reducer deposits per-segment partials on
    the weight and returns None (rlkernel.parallel.token_segments.weight_reducer). Every implementation's backward
    honours it."""
    token = _WEIGHT_GRAD.set(fn)
    try:
        yield
    finally:
        _WEIGHT_GRAD.reset(token)


def reduce_weight_grad(ctx, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight gradient from the backward's per-row products: the reducer in effect at the forward, else the tree
    over all rows, cast once."""
    return ctx.reduce_w(rows) if ctx.reduce_w is not None else tree_sum(rows, dim=0).to(dtype)


def forward(x, weight, eps, residual=None):
    """(y, h) with h = x (+ residual) in x.dtype."""
    h = x if residual is None else x + residual
    hf = h.float()
    ms = tree_sum(hf * hf, dim=-1) / h.shape[-1]
    y = (hf * strict_rsqrt(ms + eps).unsqueeze(-1)).to(h.dtype)
    return y.to(weight.dtype) * weight, h


class RmsNormFn(torch.autograd.Function):
    """Forward bits from `fwd` (a kernel or `forward`); backward by trees over the row (dh) and
    over rows (dw): deterministic, thread-independent, the same for every implementation."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual, fwd):
        y, h = fwd(x, weight, eps, residual)
        ctx.save_for_backward(h, weight)
        ctx.eps, ctx.has_residual = eps, residual is not None
        ctx.reduce_w = _WEIGHT_GRAD.get()
        return (y, h) if residual is not None else y

    @staticmethod
    def backward(ctx, gy, gh_out=None):
        h, w = ctx.saved_tensors
        hf, H = h.float(), h.shape[-1]
        rstd = strict_rsqrt(tree_sum(hf * hf, dim=-1) / H + ctx.eps)[..., None]
        xhat = hf * rstd
        g32 = gy.float()
        gw = None
        if ctx.needs_input_grad[1]:
            normed = xhat.to(h.dtype).to(w.dtype).float()  # what the forward multiplied the weight by
            gw = reduce_weight_grad(ctx, (g32 * normed).reshape(-1, H), w.dtype)
        gyw = g32 * w.float()
        gh = rstd * (gyw - xhat * (tree_sum(gyw * xhat, dim=-1) / H)[..., None])
        if gh_out is not None:
            gh = gh + gh_out.float()
        gx = gh.to(h.dtype)
        return gx, gw, None, (gx if ctx.has_residual else None), None


def rms_norm(x, weight, eps, residual=None, *, fwd=forward):
    if wants_grad(x, weight, residual):
        return RmsNormFn.apply(x, weight, eps, residual, fwd)
    y, h = fwd(x, weight, eps, residual)
    return y if residual is None else (y, h)
