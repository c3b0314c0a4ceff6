"""Rotary position embedding (NeoX/HF `rotate_half` layout).

Strict contract: one cos/sin table per (head_dim, theta), computed on the host
in float64 in fixed blocks of ROPE_BLOCK positions and rounded once to float32,
so an entry never depends on how many positions were asked for nor on the
device (the engines share bits, not code paths). Rotation in fp32, one cast to
the activation dtype. Native: HF's formula in the activation dtype.
"""
from __future__ import annotations

import threading

import torch

from .. import dispatch, fused
from ..contract import Contract

ROPE_BLOCK = 256

REFERENCE = Contract(
    op="rope",
    backend="reference",
    domain="none (element-wise)",
    partition=(("table_block", ROPE_BLOCK), ("layout", "rotate_half")),
    merge="none",
    precision=(("table", "float64 -> float32 once"), ("compute", "float32"), ("output", "x.dtype")),
    rounding=("x widened to fp32", "x1*cos - x2*sin, x2*cos + x1*sin in fp32", "one cast to x.dtype"),
    primitives=(("inv_freq", "1/theta**(2i/d), float64 on host"), ("cos/sin", "float64 torch on host, fixed blocks")),
    invariant=("batch", "prefill/decode (by position)", "table length", "device"),
)
NATIVE = Contract(
    op="rope",
    backend="native",
    domain="none (element-wise)",
    partition=(("table", "whole length, library"), ("layout", "rotate_half")),
    merge="none",
    precision=(("table", "float32 -> x.dtype"), ("compute", "x.dtype"), ("output", "x.dtype")),
    rounding=("cos/sin cast to x.dtype", "x*cos + rotate_half(x)*sin in x.dtype"),
    primitives=(("cos/sin", "float32 torch over the whole table"),),
)

_LOCK = threading.Lock()
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(head_dim: int, n_positions: int, theta: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [>= n_positions, head_dim // 2] float32, grown in fixed blocks and cached."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    device = torch.device(device)
    key = (head_dim, float(theta), device)
    with _LOCK:
        cos, sin = _TABLES.get(key, (None, None))
        have = 0 if cos is None else cos.shape[0]
        if have >= n_positions:
            return cos, sin
        inv_freq = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        new_c, new_s = [], []
        for start in range(have, n_positions, ROPE_BLOCK):
            pos = torch.arange(start, start + ROPE_BLOCK, dtype=torch.float64)
            ang = pos[:, None] * inv_freq[None, :]
            new_c.append(torch.cos(ang).float())
            new_s.append(torch.sin(ang).float())
        add_c = torch.cat(new_c).to(device)
        add_s = torch.cat(new_s).to(device)
        cos = add_c if cos is None else torch.cat([cos, add_c])
        sin = add_s if sin is None else torch.cat([sin, add_s])
        _TABLES[key] = (cos, sin)
        return cos, sin


class _FusedRope(torch.autograd.Function):
    """Training forward through the fused kernel (the reference bits); the backward is the
    inverse rotation (sin negated), element-wise."""

    @staticmethod
    def forward(ctx, x, positions, cos, sin):
        # constants, kept as attributes: the cached table may be an inference tensor (made under
        # vLLM's inference_mode in the same process), which save_for_backward refuses
        ctx.positions, ctx.cos, ctx.sin = positions, cos, sin
        return fused.ops().rope(x, positions, cos, sin)

    @staticmethod
    def backward(ctx, g):
        return fused.ops().rope(g.contiguous(), ctx.positions, ctx.cos, -ctx.sin), None, None, None


@dispatch.register("rope", "reference", REFERENCE)
def _rope_reference(x, positions, theta):
    d = x.shape[-1]
    cos, sin = rope_table(d, int(positions.max()) + 1 if positions.numel() else 1, theta, x.device)
    path = fused.route(x)
    if path == "kernel":
        return fused.ops().rope(x, positions, cos, sin)
    if path == "autograd":
        return _FusedRope.apply(x, positions, cos, sin)
    c = cos[positions].unsqueeze(-2)  # [T, 1, d/2]
    s = sin[positions].unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@dispatch.register("rope", "native", NATIVE)
def _rope_native(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    n = int(positions.max()) + 1 if positions.numel() else 1
    ang = torch.arange(n, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    c = emb.cos()[positions].to(x.dtype).unsqueeze(-2)
    s = emb.sin()[positions].to(x.dtype).unsqueeze(-2)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * c + rot * s


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, *, backend: str | None = None) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the absolute positions [T] (int64)."""
    if x.dim() != 3 or positions.shape != x.shape[:1]:
        raise ValueError(f"rope: want x [T, heads, d] and positions [T], got {tuple(x.shape)} and {tuple(positions.shape)}")
    return dispatch.call("rope", backend, (x, positions), x, positions, theta)
