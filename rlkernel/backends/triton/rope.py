"""RoPE on the GPU in one launch: the strict contract's own arithmetic (contracts/rope.py), bit for bit
the reference composition `reference.rope.forward`.

Why: the composition costs about eight launches a call (two table gathers, two slices widened to
float32, four products, two differences, a concatenation and the cast); two calls a layer forward
and two backward made RoPE about an eighth of the strict GRPO update's launches on an H200
(`benchmarks/h200_update_profile.json`, `op_sites`), and it ran in every eager step of the strict
rollout engine.

The arithmetic is the composition's, operation for operation, with no fused multiply-add
(`enable_fp_fusion=False`): each output is x1*c - x2*s or x2*c + x1*s from two IEEE float32
products and one IEEE float32 add or subtract of the same operands, then one round-to-nearest-even
cast to x's dtype; c and s are read from the same float32 tables (`reference.rope.rope_table`) at
the same position. So every element has the composition's bits (tests under TRITON_INTERPRET=1
compare with torch.equal; `scripts/gpu_strict_parity.py` on the GPU). The backward is the same
kernel with the sine table negated (the inverse rotation), as `reference.rope.RopeFn` defines it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import fast, next_pow2


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, H, sxt, sxh, syt, syh, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token per program: every head of row t rotated by the table row of position pos[t]."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c = tl.load(cos_ptr + p * HALF + d, mask=dm, other=0.0)[None, :]
    s = tl.load(sin_ptr + p * HALF + d, mask=dm, other=0.0)[None, :]
    mask = (h[:, None] < H) & dm[None, :]
    xo = x_ptr + t * sxt + h[:, None] * sxh + d[None, :]
    x1 = tl.load(xo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xo + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    yo = y_ptr + t * syt + h[:, None] * syh + d[None, :]
    tl.store(yo, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(yo + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


def forward(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`reference.rope.forward` in one launch: x [T, H, D] (any strides but a contiguous last dim), positions [T],
    cos/sin [>= max(positions) + 1, D/2] float32 -> [T, H, D] in x.dtype."""
    if x.dim() != 3 or positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"rope: x must be [T, H, D] with positions [T], got {tuple(x.shape)} and {tuple(positions.shape)}")
    t, h, d = x.shape
    half = d // 2
    if d % 2 or cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"rope: head_dim {d} and tables of width {cos.shape[-1]} do not match")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t and h:
        _rope_kernel_fast[(t,)](x, positions, cos, sin, y, h, x.stride(0), x.stride(1), y.stride(0), y.stride(1), HALF=half,
                           BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(half), num_warps=4,
                           enable_fp_fusion=False)
    return y

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_rope_kernel_fast = fast(_rope_kernel)
