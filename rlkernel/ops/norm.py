"""RMSNorm, reduction over the hidden dim.

Strict contract (HF Qwen3/Llama placement): the optional residual add happens in
the activation dtype and its result is the new residual; the sum of squares is
a balanced tree in fp32; rstd = 1/sqrt(mean + eps) from correctly rounded ops;
the normalised row is cast to the activation dtype *before* the weight
multiply, which is done in the weight's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch, fused
from ..contract import Contract
from ..primitives import row_scale, strict_rsqrt, tree_sum

REFERENCE = Contract(
    op="rms_norm",
    backend="reference",
    domain="hidden",
    partition=(("row", "whole row, zero-padded to a power of two"),),
    merge="balanced binary tree of fp32 adds over the row",
    precision=(("input", "x.dtype"), ("accumulate", "float32"), ("output", "x.dtype")),
    rounding=("residual add in x.dtype", "normalised row cast to x.dtype before the weight multiply", "weight multiply in weight dtype"),
    primitives=(("rsqrt", "1/sqrt(x), IEEE div and IEEE sqrt (float64 sqrt rounded once to float32)"), ("mean", "tree_sum / H")),
    invariant=("batch", "row position", "threads 1 vs 2", "run to run"),
    version=2,  # v1 used torch's float32 CPU sqrt, which is not IEEE (1 value in 6 one ulp off)
)
NATIVE = Contract(
    op="rms_norm",
    backend="native",
    domain="hidden",
    partition=(("row", "library"),),
    merge="torch F.rms_norm kernel",
    precision=(("input", "x.dtype"), ("accumulate", "library"), ("output", "x.dtype")),
    rounding=("residual add in x.dtype", "library"),
    primitives=(("rsqrt", "library rsqrt"),),
)


def _add_residual(x, residual):
    return x if residual is None else x + residual


class _FusedRmsNorm(torch.autograd.Function):
    """Training forward through the fused kernel (the reference bits); explicit backward with
    trees over the row (dh) and over rows (dw): deterministic, thread-independent."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, h = fused.ops().rms_norm(x, weight, eps, residual)
        ctx.save_for_backward(h, weight)
        ctx.eps, ctx.has_residual = eps, residual is not None
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
            gw = tree_sum((g32 * normed).reshape(-1, H), dim=0).to(w.dtype)
        gyw = g32 * w.float()
        gh = rstd * (gyw - xhat * (tree_sum(gyw * xhat, dim=-1) / H)[..., None])
        if gh_out is not None:
            gh = gh + gh_out.float()
        gx = gh.to(h.dtype)
        return gx, gw, None, (gx if ctx.has_residual else None)


@dispatch.register("rms_norm", "reference", REFERENCE)
def _rms_norm_reference(x, weight, eps, residual=None):
    path = fused.route(x, weight, residual)
    if path == "kernel":
        y, h = fused.ops().rms_norm(x, weight, eps, residual)
        return y if residual is None else (y, h)
    if path == "autograd":
        return _FusedRmsNorm.apply(x, weight, eps, residual)
    h = _add_residual(x, residual)
    hf = h.float()
    ms = tree_sum(hf * hf, dim=-1) / h.shape[-1]
    y = (hf * strict_rsqrt(ms + eps).unsqueeze(-1)).to(h.dtype)
    y = row_scale(y.to(weight.dtype), weight)
    return y if residual is None else (y, h)


@dispatch.register("rms_norm", "native", NATIVE)
def _rms_norm_native(x, weight, eps, residual=None):
    h = _add_residual(x, residual)
    y = F.rms_norm(h, (h.shape[-1],), weight, eps)
    return y if residual is None else (y, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None, *, backend: str | None = None):
    """RMSNorm over the last dim; with `residual`, returns (normed, x + residual)."""
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    return dispatch.call("rms_norm", backend, (x, weight), x, weight, eps, residual)
