"""`rms_norm(x, weight, eps, residual)` (contract: rlkernel/contracts/norm.py)."""
from __future__ import annotations

import torch

from .. import dispatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None, *, backend: str | None = None):
    """RMSNorm over the last dim; with `residual`, returns (normed, x + residual)."""
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    return dispatch.call("rms_norm", backend, (x, weight), x, weight, eps, residual)
