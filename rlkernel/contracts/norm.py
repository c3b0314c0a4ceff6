"""RMSNorm: reduction over the hidden dim (HF Qwen3/Llama placement).

The optional residual add happens in the activation dtype and its result is the new
residual; the sum of squares is a balanced tree of float32 adds; rstd = 1/sqrt(mean + eps)
from correctly rounded ops; the normalised row is cast to the activation dtype *before* the
weight multiply, which is done in the weight's dtype.
"""
from .base import Contract
from .primitives import RSQRT

STRICT = Contract(
    op="rms_norm",
    backend="strict",
    domain="hidden",
    partition=(("row", "whole row, zero-padded to a power of two"),),
    merge="balanced binary tree of fp32 adds over the row (adjacent pairs)",
    precision=(("input", "x.dtype"), ("accumulate", "float32"), ("output", "weight.dtype")),
    rounding=("residual add in x.dtype", "normalised row cast to x.dtype before the weight multiply", "weight multiply in weight dtype"),
    primitives=(RSQRT, ("mean", "tree_sum / H")),
    invariant=("batch", "row position", "threads", "ISA", "run to run"),
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
