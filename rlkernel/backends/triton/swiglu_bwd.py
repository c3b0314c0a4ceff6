"""SwiGLU's backward in one launch: the contract's float32 arithmetic (`reference.swiglu.backward`), bit for bit.

Why: the composition is about a dozen element-wise launches a layer (casts, exp, reciprocal, products, sums), one of
the strict GRPO update's launch-bound sites on an H200 (`benchmarks/h200_update_profile.json`, `op_sites`).

The arithmetic is the composition's, operation for operation, in the same order, with no fused multiply-add
(`enable_fp_fusion=False`) and IEEE division (`tl.div_rn`): s = 1 / (exp(-g) + 1), silu = g s,
dgate = (dy u) (s (1 + g (1 - s))), dup = dy silu, each one float32 rounding, then one cast to the input's dtype.
exp is libdevice's `exp` on the GPU, CUDA's expf, which torch.exp calls on CUDA (the GPU check compares them:
`scripts/gpu_strict_parity.py --only reduce`, `swiglu_backward_equal`); under TRITON_INTERPRET=1, which has no
libdevice, `tl.exp` (numpy's exp), and the tests compare against the composition with numpy's exp, which checks the
order of the arithmetic.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from .launch import fast, cdiv

try:  # Triton 3.x
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older layouts
    libdevice = None


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit(do_not_specialize=["n_elem", "cols"])
def _swiglu_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n_elem, cols, sg, su, sd,
                       BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Element i of the [n_elem / cols, cols] operands (rows of their own strides: gate and up are column halves of
    fc1's output); the gradients are written contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    row, col = offs // cols, offs % cols
    g = tl.load(g_ptr + row * sg + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + col, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * sd + col, mask=mask, other=0.0).to(tl.float32)
    s = tl.div_rn(tl.full(g.shape, 1.0, tl.float32), _exp(-g, LIBDEVICE) + 1.0)
    silu = g * s
    dgate = (dy * u) * (s * (1.0 + g * (1.0 - s)))
    tl.store(dg_ptr + offs, dgate.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * silu).to(du_ptr.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate in gate.dtype, dup in up.dtype) of silu(gate) * up for the upstream gradient dy, one launch."""
    if gate.shape != up.shape or dy.shape != gate.shape:
        raise ValueError(f"swiglu backward: gate {tuple(gate.shape)}, up {tuple(up.shape)} and dy {tuple(dy.shape)} differ")
    cols = gate.shape[-1] if gate.dim() else 1

    def rows(t):  # a [rows, cols] view with a unit column stride, copied only where none exists
        t2 = t.reshape(-1, cols) if t.dim() else t.reshape(1, 1)
        return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()

    g, u, d = rows(gate), rows(up), rows(dy)
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    lib = not interpreted()
    if lib and libdevice is None:
        raise RuntimeError("swiglu backward: this Triton has no triton.language.extra.libdevice (the strict exp)")
    if n:
        _swiglu_bwd_kernel_fast[(cdiv(n, 1024),)](g, u, d, dg, du, n, cols, g.stride(0), u.stride(0), d.stride(0),
                                                    BLOCK=1024, LIBDEVICE=lib, num_warps=4, enable_fp_fusion=False)
    return dg, du

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_swiglu_bwd_kernel_fast = fast(_swiglu_bwd_kernel)
