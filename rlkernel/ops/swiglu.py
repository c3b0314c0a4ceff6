"""`swiglu(gate, up)` = silu(gate) * up (contract: rlkernel/contracts/swiglu.py), and `linear_swiglu`: the MLP's
first half, a fused gate/up linear and swiglu, one launch where the backend has the epilogue."""
from __future__ import annotations

import torch

from .. import dispatch
from ._dtypes import data_dtype


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up, element-wise; gate and up of equal shape."""
    data_dtype("swiglu", gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return dispatch.call("swiglu", backend, (gate, up), gate, up)


def linear_swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """swiglu(gate, up) of [gate | up] = linear(x, gate_up_weight), gate_up_weight = [Wg; Wu] of shape [2I, K] ->
    [..., I]: the bits of that composition under the current policy (both ops' contracts). Where the implementations
    that would run it registered a fusion (`dispatch.register_fusion`: the Triton GEMM's SwiGLU epilogue, which rounds
    gate and up to x.dtype and then runs swiglu's arithmetic) and no gradient is wanted, it is one launch; provenance
    still records both ops. Under a `dispatch.tap` it runs the two ops, so the tap sees each."""
    from .linear import linear

    data_dtype("linear_swiglu", x=x, gate_up_weight=gate_up_weight)
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[-1] != x.shape[-1] or gate_up_weight.shape[0] % 2:
        raise ValueError(f"linear_swiglu: x has K={x.shape[-1]} but the gate/up weight is {tuple(gate_up_weight.shape)} "
                         f"(want [2I, {x.shape[-1]}])")
    y = dispatch.call_fusion(("linear", "swiglu"), backend, ((x, gate_up_weight), (x,)), x, gate_up_weight)
    if y is not None:
        return y
    gate, up = linear(x, gate_up_weight, backend=backend).chunk(2, dim=-1)
    return swiglu(gate, up, backend=backend)
