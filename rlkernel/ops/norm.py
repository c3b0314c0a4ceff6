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


@dispatch.register("rms_norm", "reference", REFERENCE)
def _rms_norm_reference(x, weight, eps, residual=None):
    if fused.active(x, weight, residual):
        y, h = fused.ops().rms_norm(x, weight, eps, residual)
        return y if residual is None else (y, h)
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
