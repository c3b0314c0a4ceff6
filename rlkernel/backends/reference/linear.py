"""GEMM ops under the strict contract (contracts/gemm.py): the composition and the shared autograd.

What this module decides: how `linear` (and a plain differentiable GEMM, `matmul_fn`) are
computed from an implementation's primitives, forward and backward. The backward is
explicit — dx = g W, dW = g^T x (a GEMM over tokens, ascending), db = tree over rows — and
shared by every implementation, so the C++ kernels and this composition give the same
gradients bit for bit (autograd through a composition would not: its graph is another order).
"""
from __future__ import annotations

import torch

from .primitives import REFERENCE, Prims, tree_sum


def segment_partials(x2: torch.Tensor, weight: torch.Tensor, k_segments: int, mm) -> list[torch.Tensor]:
    """float32 [M, N] partial of each of `k_segments` equal K-slices (each its own fma chain)."""
    k = x2.shape[-1]
    if k_segments < 1 or k % k_segments:
        raise ValueError(f"linear: K={k} is not divisible into {k_segments} canonical segments")
    seg = k // k_segments
    return [mm(x2[:, i * seg:(i + 1) * seg], weight[:, i * seg:(i + 1) * seg].t()) for i in range(k_segments)]


def forward(x, weight, bias=None, k_segments: int = 1, prims: Prims = REFERENCE):
    """y = x @ weight.T (+ bias) under the contract, in x's dtype."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if k_segments == 1:
        out = prims.matmul(x2, weight.t())
    else:
        out = tree_sum(torch.stack(segment_partials(x2, weight, k_segments, prims.matmul), dim=-1), dim=-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


class LinearFn(torch.autograd.Function):
    """forward(x, weight, bias, k_segments, fwd, prims): `fwd` computes the forward bits (a kernel
    or `forward`); the backward is the contract's GEMMs through `prims.matmul`."""

    @staticmethod
    def forward(ctx, x, weight, bias, k_segments, fwd, prims):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype, ctx.prims = (None if bias is None else bias.dtype), prims
        return fwd(x, weight, bias, k_segments)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        mm = ctx.prims.matmul
        g32 = g.reshape(-1, w.shape[0]).float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = mm(g32, w).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = mm(g32.t(), x.reshape(-1, x.shape[-1])).to(w.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            gb = tree_sum(g32, dim=0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None, None


class MatmulFn(torch.autograd.Function):
    """float32 a @ b under the contract with the contract's backward GEMMs (a [M, K], b [K, N])."""

    @staticmethod
    def forward(ctx, a, b, prims):
        ctx.save_for_backward(a, b)
        ctx.prims = prims
        return prims.matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        mm = ctx.prims.matmul
        ga = mm(g, b.t()).to(a.dtype) if ctx.needs_input_grad[0] else None
        gb = mm(a.t(), g).to(b.dtype) if ctx.needs_input_grad[1] else None
        return ga, gb, None


def wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x, weight, bias=None, k_segments: int = 1, *, prims: Prims = REFERENCE, fwd=None):
    """The op for one implementation: its forward bits (`fwd`, default the composition), with the
    shared backward when a graph is wanted."""
    fwd = fwd or (lambda x, w, b, s: forward(x, w, b, s, prims))
    if wants_grad(x, weight, bias):
        return LinearFn.apply(x, weight, bias, k_segments, fwd, prims)
    return fwd(x, weight, bias, k_segments)


def partials(x, weight, k_segments: int, *, prims: Prims = REFERENCE) -> list[torch.Tensor]:
    """Differentiable float32 partials [M, N] of `k_segments` K-slices (a row-parallel TP rank's share)."""
    x2 = x.reshape(-1, x.shape[-1])
    if wants_grad(x, weight):
        return segment_partials(x2, weight, k_segments, lambda a, b: MatmulFn.apply(a, b, prims))
    return segment_partials(x2, weight, k_segments, prims.matmul)
