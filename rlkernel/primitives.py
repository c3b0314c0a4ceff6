"""Position-independent math primitives for the strict path.

What this module decides: how exp, log, rsqrt, SiLU and every reduction of the
strict reference backend are computed. Why: vectorised transcendental kernels
(Sleef on CPU) and their scalar tails return different bits for the same input,
so an element's *position* in a tensor would decide its value, and so would the
batch it sits in. Here every primitive is built only from IEEE-754 operations
that are correctly rounded in any code path (+, -, *, /, sqrt, max, integer bit
ops). The same formula therefore gives the same bits on the SIMD body and the
scalar tail, on 1 or 2 threads, and on any device where torch runs those ops as
separate kernels (CPU, CUDA, ROCm).

Reductions are explicit trees of element-wise adds (``tree_sum``) or fixed-shape
tile GEMMs (``tile_matmul``), never torch's own reduction kernels whose split
depends on the shape and the thread count.
"""
from __future__ import annotations

import math

import torch

from . import fused

__all__ = [
    "TILE_ROWS",
    "strict_exp",
    "strict_log",
    "strict_rsqrt",
    "strict_sqrt",
    "strict_silu",
    "tree_sum",
    "tile_matmul",
    "pad_rows",
    "row_scale",
]

# Rows per GEMM tile. A fixed [TILE_ROWS, K] x [K, N] problem always takes the
# same BLAS path, whatever the number of rows the caller has; measured on this
# CPU (oneDNN/MKL, fp32 and bf16, 1 and 2 threads) a row's bits do not depend on
# the tile's other rows nor on the number of tiles in the batched call.
TILE_ROWS = 16

_LOG2E = 1.4426950408889634
# Cody-Waite split of ln 2: _LN2_HI has trailing zero bits so n * _LN2_HI is exact.
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
# Taylor coefficients of exp on [-ln2/2, ln2/2]; degree 7 keeps the truncation
# error below float32 resolution (|r|^8/8! < 2e-8).
_EXP_C = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040)
_EXP_MIN = -87.33  # below: result flushes to exactly 0 (no subnormals)
_EXP_MAX = 88.72
_SQRT_HALF = math.sqrt(0.5)


def _pow2i(n: torch.Tensor) -> torch.Tensor:
    """2**n for integer-valued float32 n in [-126, 127], built from the exponent bits."""
    bits = (n.to(torch.int32) + 127) * (1 << 23)
    return bits.view(torch.float32)


def _exp_inplace(x: torch.Tensor) -> torch.Tensor:
    """strict_exp without autograd: the same operations in the same order, on few buffers
    (every op is correctly rounded, so in-place or not gives the same bits; tested)."""
    r = torch.clamp(x, _EXP_MIN, _EXP_MAX)
    n = torch.mul(r, _LOG2E).round_()
    t = torch.mul(n, _LN2_HI)
    r.sub_(t)
    r.sub_(t.copy_(n).mul_(_LN2_LO))
    p = torch.mul(r, _EXP_C[-1]).add_(_EXP_C[-2])
    for c in reversed(_EXP_C[:-2]):
        p.mul_(r).add_(c)
    n1 = t.copy_(n).mul_(0.5).floor_()
    p.mul_(_pow2i(n1)).mul_(_pow2i(n.sub_(n1)))
    p.masked_fill_(x < _EXP_MIN, 0.0)
    p.masked_fill_(x > _EXP_MAX, math.inf)
    return torch.where(torch.isnan(x), x, p)


def strict_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32 from range reduction + Horner; exp(0) == 1 and exp(-inf) == 0 exactly."""
    x = x.float()
    if not (torch.is_grad_enabled() and x.requires_grad):
        if fused.active(x):
            return fused.ops().exp(x)
        return _exp_inplace(x)
    xc = torch.clamp(x, _EXP_MIN, _EXP_MAX)
    n = torch.round(xc * _LOG2E)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_C[-1])
    for c in reversed(_EXP_C[:-1]):
        p = p * r + c
    # 2**n as two exact power-of-two factors so n = 128 (x near 88.7) cannot overflow the exponent field.
    n1 = torch.floor(n * 0.5)
    y = (p * _pow2i(n1)) * _pow2i(n - n1)
    y = torch.where(x < _EXP_MIN, torch.zeros_like(y), y)
    y = torch.where(x > _EXP_MAX, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x), x, y)


def strict_log(x: torch.Tensor) -> torch.Tensor:
    """log(x) in float32 for x > 0 (normal numbers) via exponent split and atanh series."""
    x = x.float()
    if fused.active(x):
        return fused.ops().log(x)
    bits = x.view(torch.int32)
    e = torch.bitwise_right_shift(bits, 23) - 127
    # x * 2**-e is exact (a power-of-two scale of a normal number) and keeps x in the autograd graph.
    m = x * _pow2i(-e.float())  # in [1, 2)
    big = m > (2 * _SQRT_HALF)
    m = torch.where(big, m * 0.5, m)  # now in [sqrt(1/2), sqrt(2))
    e = torch.where(big, e + 1, e).float()
    f = m - 1.0
    s = f / (f + 2.0)
    s2 = s * s
    # 2*atanh(s) = 2(s + s^3/3 + ... + s^11/11); |s| < 0.1716
    q = torch.full_like(s, 2.0 / 11)
    for k in (9, 7, 5, 3):
        q = q * s2 + 2.0 / k
    q = q * s2 + 2.0
    logm = q * s
    y = e * _LN2_HI + (logm + e * _LN2_LO)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x < 0, torch.full_like(y, math.nan), y)
    return torch.where(torch.isinf(x) & (x > 0), x, y)


def strict_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt: float64 sqrt, rounded once to float32.

    torch's float32 CPU sqrt (MKL VML) is not correctly rounded: measured here, one value in
    six is one ulp off IEEE sqrt (CUDA's is exact, so the two devices disagreed). A float32's
    square root never lies within float64's error of a float32 rounding midpoint, so the
    float64 route gives the IEEE result on every device (tests/test_fused_cpu.py checks it
    against numpy's hardware sqrt).
    """
    return torch.sqrt(x.double()).float()


def strict_rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x): two correctly rounded ops (torch's rsqrt and float32 CPU sqrt are not)."""
    x = x.float()
    return 1.0 / strict_sqrt(x)


def strict_silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)), float32."""
    x = x.float()
    if not (torch.is_grad_enabled() and x.requires_grad):
        d = strict_exp(torch.neg(x)).add_(1.0)
        return torch.div(x, d, out=d)
    return x / (1.0 + strict_exp(-x))


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by a balanced binary tree of element-wise adds.

    The length is zero-padded to the next power of two, then adjacent pairs
    are added (a[0::2] + a[1::2]) until one element is left, so any aligned
    power-of-two block of summands (a rank's block of canonical segments) is a
    subtree. Adding +0.0 never changes a value's bits, so the result depends
    only on the summands and their index.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def pad_rows(x: torch.Tensor, multiple: int = TILE_ROWS) -> torch.Tensor:
    """Zero-pad dim -2 of x up to a multiple of `multiple` rows."""
    m = x.shape[-2]
    rem = (-m) % multiple
    if rem == 0:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, rem))


# On CUDA, cuBLAS picks its batched-GEMM kernel by batch count and operand strides
# (measured on an H200: fp32 rows change bits from 2 tiles up), so a 2-D product runs as
# one plain GEMM per fixed block of CUDA_BLOCK_ROWS rows instead — the same problem shape
# for every block, whatever M is.
CUDA_BLOCK_ROWS = 128


def _cuda_blocks(a2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a2.shape[0]
    ap = pad_rows(a2, CUDA_BLOCK_ROWS)
    bc = b.contiguous()
    out = torch.cat([ap[i:i + CUDA_BLOCK_ROWS] @ bc for i in range(0, ap.shape[0], CUDA_BLOCK_ROWS)])
    return out[:m]


def _tile_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a row-invariant result: a [..., M, K], b [K, N] or [..., K, N].

    Rows of `a` are split into zero-padded tiles of TILE_ROWS, every tile is one
    problem of the batched GEMM, so each row meets the same kernel whatever M
    is. Returns [..., M, N] in the inputs' dtype (accumulation is the BLAS
    kernel's, fp32 for fp32 and bf16).
    """
    m, k = a.shape[-2], a.shape[-1]
    batch = a.shape[:-2]
    if a.is_cuda and b.dim() == 2:
        return _cuda_blocks(a.reshape(-1, k), b).reshape(*batch, m, b.shape[-1])
    ap = pad_rows(a)
    t = ap.shape[-2] // TILE_ROWS
    if b.dim() == 2:
        b = b.expand(*batch, k, b.shape[-1])
    n = b.shape[-1]
    at = ap.reshape(-1, TILE_ROWS, k)
    bt = b.unsqueeze(-3).expand(*batch, t, k, n).reshape(-1, k, n)
    out = torch.bmm(at, bt).reshape(*batch, t * TILE_ROWS, n)
    return out[..., :m, :]


class _TileMatmul(torch.autograd.Function):
    """tile_matmul with a deterministic backward (no torch reduction over expanded dims)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _tile_matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _tile_matmul(g, b.transpose(-1, -2))
        if ctx.needs_input_grad[1]:
            # dL/db = a^T g: the reduction over a's rows is one fixed-shape BLAS problem
            # per batch entry (rows of a^T tiled as usual), so no split depends on threads.
            if b.dim() == 2 and a.dim() > 2:
                a2 = a.reshape(-1, a.shape[-1])
                g2 = g.reshape(-1, g.shape[-1])
                gb = _tile_matmul(a2.transpose(0, 1), g2)
            else:
                gb = _tile_matmul(a.transpose(-1, -2), g)
        return ga, gb


def tile_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a row-invariant result and a deterministic backward (see _tile_matmul)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _TileMatmul.apply(a, b)
    return _tile_matmul(a, b)


class _RowScale(torch.autograd.Function):
    """x * w with w broadcast over x's leading dims; dL/dw by a tree over the rows."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = tree_sum((g * x).reshape(-1, w.shape[-1]).float(), dim=0).to(w.dtype)
        return gx, gw


def row_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x * w (w of shape [x.shape[-1]]) whose weight gradient is a fixed tree over rows."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _RowScale.apply(x, w)
    return x * w
