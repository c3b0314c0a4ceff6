"""SwiGLU under the strict contract (contracts/swiglu.py): composition and shared explicit backward."""
from __future__ import annotations

import torch

from .linear import wants_grad
from .primitives import REFERENCE, Prims, strict_silu


def forward(gate, up):
    return (strict_silu(gate) * up.float()).to(gate.dtype)


class SwigluFn(torch.autograd.Function):
    """Forward bits from `fwd`; element-wise backward with the strict exp:
    silu' = s (1 + g (1 - s)), s = 1 / (1 + exp(-g)) (`backward`, or `bwd`: an implementation's one-kernel version of
    the same arithmetic, bit for bit)."""

    @staticmethod
    def forward(ctx, gate, up, fwd, prims, bwd=None):
        ctx.save_for_backward(gate, up)
        ctx.prims, ctx.bwd = prims, bwd
        return fwd(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        dgate, dup = (ctx.bwd or (lambda a, b, c: backward(a, b, c, ctx.prims)))(gate, up, g)
        return dgate, dup, None, None, None


def backward(gate, up, g, prims: Prims = REFERENCE):
    """(dgate, dup) of silu(gate) * up for the upstream gradient g: the contract's float32 arithmetic, in this order."""
    gf, uf, g32 = gate.float(), up.float(), g.float()
    s = 1.0 / (prims.exp(-gf) + 1.0)
    silu = gf * s
    dgate = g32 * uf * (s * (1.0 + gf * (1.0 - s)))
    return dgate.to(gate.dtype), (g32 * silu).to(up.dtype)


def swiglu(gate, up, *, prims: Prims = REFERENCE, fwd=forward, bwd=None):
    if wants_grad(gate, up):
        return SwigluFn.apply(gate, up, fwd, prims, bwd)
    return fwd(gate, up)
