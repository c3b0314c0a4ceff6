"""`rms_norm(x, weight, eps, residual)` (contract: rlkernel/contracts/norm.py)."""
from __future__ import annotations

import math

import torch

from .. import dispatch
from ._dtypes import data_dtype


def _eps(name: str, eps) -> None:
    try:
        ok = math.isfinite(float(eps)) and float(eps) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None, *, backend: str | None = None):
    """RMSNorm over the last dim; with `residual` (x's dtype), returns (normed, x + residual). The output is in the
    weight's dtype (contracts/norm.py), the new residual in x's."""
    _eps("rms_norm", eps)
    data_dtype("rms_norm", x=x, residual=residual)  # (the weight may differ: the output is in its dtype)
    data_dtype("rms_norm", weight=weight)
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    return dispatch.call("rms_norm", backend, (x, weight), x, weight, eps, residual)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, theta: float, *,
                  max_position: int | None = None, backend: str | None = None) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps), positions, theta): Qwen3's per-head q/k norm and the rotation, x [T, heads, D].
    The bits of that composition under the current policy (both ops' contracts). Where the implementations that would
    run it registered a fusion (the Triton norm kernel with the rope kernel's arithmetic in its epilogue, reading a
    strided q/k view without a copy) and no gradient is wanted, it is one launch; provenance still records both ops.
    Under a `dispatch.tap` it runs the two ops, so the tap sees each."""
    from .rope import _positions, rope

    _eps("rms_norm_rope", eps)
    _positions("rms_norm_rope", positions, theta)
    data_dtype("rms_norm_rope", x=x)
    data_dtype("rms_norm_rope", weight=weight)
    if x.dim() != 3 or positions.shape != x.shape[:1]:
        raise ValueError(f"rms_norm_rope: want x [T, heads, d] and positions [T], got {tuple(x.shape)} and "
                         f"{tuple(positions.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_rope: weight {tuple(weight.shape)} does not match head_dim {x.shape[-1]}")
    if x.shape[-1] % 2:
        raise ValueError(f"rms_norm_rope: head_dim must be even, got {x.shape[-1]}")
    y = dispatch.call_fusion(("rms_norm", "rope"), backend, ((x, weight), (x, positions)), x, weight, eps, positions,
                             theta, max_position)
    if y is not None:
        return y
    return rope(rms_norm(x, weight, eps, backend=backend), positions, theta, backend=backend, max_position=max_position)
