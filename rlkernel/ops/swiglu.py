"""`swiglu(gate, up)` = silu(gate) * up (contract: rlkernel/contracts/swiglu.py)."""
from __future__ import annotations

import torch

from .. import dispatch


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up, element-wise; gate and up of equal shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return dispatch.call("swiglu", backend, (gate, up), gate, up)
