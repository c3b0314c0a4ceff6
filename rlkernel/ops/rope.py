"""`rope(x, positions, theta)`: rotary embedding, rotate_half layout (contract: rlkernel/contracts/rope.py)."""
from __future__ import annotations

import math

import torch

from .. import dispatch
from ._dtypes import data_dtype
from ..backends.reference.rope import rope_table

__all__ = ["rope", "rope_table"]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, *, backend: str | None = None,
         max_position: int | None = None) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the absolute positions [T] (int64). max_position: a bound
    on the positions the caller knows (sizes the table without reading the positions back)."""
    _positions("rope", positions, theta)
    data_dtype("rope", x=x)
    if x.dim() != 3 or positions.shape != x.shape[:1]:
        raise ValueError(f"rope: want x [T, heads, d] and positions [T], got {tuple(x.shape)} and {tuple(positions.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"rope: head_dim must be even, got {x.shape[-1]}")
    hint = {} if max_position is None else {"max_position": int(max_position)}
    return dispatch.call("rope", backend, (x, positions), x, positions, theta, **hint)


def _positions(name: str, positions, theta) -> None:
    """rope's arguments that no kernel checks: integer positions (a float one would be truncated) and theta > 0 (the
    values are bounded by the implementations: >= 0 and below the table, on the device on GPUs)."""
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name}: positions must be an integer tensor, got {got}")
    try:
        ok = math.isfinite(float(theta)) and float(theta) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name}: theta must be a finite number > 0, got {theta!r}")
