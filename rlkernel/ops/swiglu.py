"""SwiGLU activation: silu(gate) * up.

Strict contract: gate and up arrive materialised in the activation dtype (the
outputs of the gate/up GEMM are rounded there: that is the materialisation
boundary); SiLU is x / (1 + exp(-x)) in fp32 with the position-independent exp;
the product is fp32; one rounding to the activation dtype. Native: torch's SiLU
(vectorised body and scalar tail differ) and a multiply in the activation dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch, fused
from ..contract import Contract
from ..primitives import strict_exp, strict_silu

REFERENCE = Contract(
    op="swiglu",
    backend="reference",
    domain="none (element-wise)",
    partition=(("gate_up", "materialised in activation dtype before SiLU"),),
    merge="none",
    precision=(("input", "act dtype"), ("compute", "float32"), ("output", "act dtype")),
    rounding=("gate/up rounded to act dtype by the GEMM", "one cast after silu(gate)*up in fp32"),
    primitives=(("silu", "x / (1 + exp(-x))"), ("exp", "Cody-Waite + degree-7 Horner, fp32")),
    invariant=("batch", "row position", "threads 1 vs 2", "run to run"),
)
NATIVE = Contract(
    op="swiglu",
    backend="native",
    domain="none (element-wise)",
    partition=(("gate_up", "materialised in activation dtype before SiLU"),),
    merge="none",
    precision=(("input", "act dtype"), ("compute", "library"), ("output", "act dtype")),
    rounding=("silu rounded to act dtype", "product rounded to act dtype"),
    primitives=(("silu", "torch vectorised silu (Sleef) / scalar tail"),),
)


class _FusedSwiGLU(torch.autograd.Function):
    """Training forward through the fused kernel (the reference bits); element-wise backward
    with the position-independent exp: silu' = s (1 + g (1 - s)), s = 1 / (1 + exp(-g))."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return fused.ops().swiglu(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        gf, uf, g32 = gate.float(), up.float(), g.float()
        s = 1.0 / (strict_exp(-gf) + 1.0)
        silu = gf * s
        dgate = g32 * uf * (s * (1.0 + gf * (1.0 - s)))
        return dgate.to(gate.dtype), (g32 * silu).to(up.dtype)


@dispatch.register("swiglu", "reference", REFERENCE)
def _swiglu_reference(gate, up):
    path = fused.route(gate, up)
    if path == "kernel":
        return fused.ops().swiglu(gate, up)
    if path == "autograd":
        return _FusedSwiGLU.apply(gate, up)
    return (strict_silu(gate) * up.float()).to(gate.dtype)


@dispatch.register("swiglu", "native", NATIVE)
def _swiglu_native(gate, up):
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up, element-wise; gate and up of equal shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return dispatch.call("swiglu", backend, (gate, up), gate, up)
