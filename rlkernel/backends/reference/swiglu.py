"""SwiGLU under the strict contract (contracts/swiglu.py): composition and shared explicit backward."""
from __future__ import annotations

import torch

from .linear import wants_grad
from .primitives import REFERENCE, Prims, strict_silu


def forward(gate, up):
    return (strict_silu(gate) * up.float()).to(gate.dtype)


class SwigluFn(torch.autograd.Function):
    """Forward bits from `fwd`; element-wise backward with the strict exp:
    silu' = s (1 + g (1 - s)), s = 1 / (1 + exp(-g))."""

    @staticmethod
    def forward(ctx, gate, up, fwd, prims):
        ctx.save_for_backward(gate, up)
        ctx.prims = prims
        return fwd(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        gf, uf, g32 = gate.float(), up.float(), g.float()
        s = 1.0 / (ctx.prims.exp(-gf) + 1.0)
        silu = gf * s
        dgate = g32 * uf * (s * (1.0 + gf * (1.0 - s)))
        return dgate.to(gate.dtype), (g32 * silu).to(up.dtype), None, None


def swiglu(gate, up, *, prims: Prims = REFERENCE, fwd=forward):
    if wants_grad(gate, up):
        return SwigluFn.apply(gate, up, fwd, prims)
    return fwd(gate, up)
