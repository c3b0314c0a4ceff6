"""The strict primitives as a torch composition: exp, log, rsqrt, SiLU, fma, GEMM, tree sums.

What this module decides: how the reference implementation computes every primitive of the
strict contracts (rlkernel/contracts/primitives.py, gemm.py). Why: vectorised transcendental
kernels (Sleef on CPU) and their scalar tails return different bits for the same input, and
every vendor GEMM (MKL, oneDNN, cuBLAS) picks its K order by shape, thread count and ISA.
Here every primitive is built only from element-wise IEEE-754 operations that are correctly
rounded in any code path (+, -, *, /, sqrt, max, nextafter, integer bit ops), so the same
formula gives the same bits on the SIMD body and the scalar tail, on any thread count, any
x86-64 ISA and on CUDA. This is the executable spec: slow, and the thing the C++ kernels
(rlkernel/backends/cpu) must equal bit for bit.

Reductions are explicit: `tree_sum` (balanced trees of element-wise adds) and `matmul` (per
output one float32 fma chain over K ascending, `fma` emulated exactly in float64).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...contracts.primitives import EXP_C as _EXP_C
from ...contracts.primitives import EXP_MAX as _EXP_MAX
from ...contracts.primitives import EXP_MIN as _EXP_MIN
from ...contracts.primitives import LN2_HI as _LN2_HI
from ...contracts.primitives import LN2_LO as _LN2_LO
from ...contracts.primitives import LOG2E as _LOG2E
from ...contracts.primitives import SQRT_HALF as _SQRT_HALF

__all__ = ["Prims", "REFERENCE", "strict_exp", "strict_log", "strict_rsqrt", "strict_sqrt", "strict_silu", "tree_sum",
           "fma", "matmul"]


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
    float64 route gives the IEEE result on every device (tests/test_cpu_kernels.py checks it
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


_DEVICE_TREE: dict[str, tuple[Callable, Callable[[], bool]]] = {}


def register_tree_sum(device_type: str, impl: Callable, ready: Callable[[], bool]) -> None:
    """A device's kernel for `tree_sum` (float32, outside autograd): impl(x [n, m]) -> [m], the tree over dim 0 with
    this function's bits exactly (the same adds of the same operands); used when ready() (e.g. triton imports)."""
    _DEVICE_TREE[device_type] = (impl, ready)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by a balanced binary tree of element-wise adds.

    The length is zero-padded to the next power of two, then adjacent pairs
    are added (a[0::2] + a[1::2]) until one element is left, so any aligned
    power-of-two block of summands (a rank's block of canonical segments) is a
    subtree. Adding +0.0 never changes a value's bits, so the result depends
    only on the summands and their index. On a device with a registered kernel
    (`register_tree_sum`: the Triton backend on CUDA) a float32 sum outside autograd runs
    there in a few launches, with the same adds and so the same bits.
    """
    fast = _DEVICE_TREE.get(x.device.type)
    # an empty sum (a vocab's last canonical segment may hold no rows) is the composition's +0.0 (no kernel launch)
    if (fast is not None and x.dtype == torch.float32 and x.dim() and x.shape[dim]
            and not (torch.is_grad_enabled() and x.requires_grad)):
        impl, ready = fast
        if ready():
            y = x.movedim(dim, 0)
            return impl(y.reshape(y.shape[0], -1)).reshape(y.shape[1:])
    return tree_sum_composition(x, dim)


def tree_sum_composition(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`tree_sum` as element-wise torch ops on any device (the definition a device kernel is checked against)."""
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


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c) = a*b + c rounded once, exactly, from element-wise float64 ops.

    a*b of two float32 is exact in float64 (48 significant bits); s = a*b + c rounded to
    float64 and its exact error e (TwoSum) give the exact sum s + e; rounding s *to odd*
    (the odd one of s and its neighbour towards e when e != 0) and then to float32 rounds the
    exact sum once (float64 has more than 24 + 2 bits), so no double rounding. Inputs are
    float32 tensors (broadcast); inf/nan propagate as in IEEE fma.
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    nudge = (e != 0) & even & torch.isfinite(s)
    s = torch.where(nudge, torch.nextafter(s, torch.where(e > 0, math.inf, -math.inf).to(s.dtype)), s)
    return s.float()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a @ b under the GEMM contract: a [..., M, K], b [K, N] or [..., K, N].

    Every output is one fma chain over K ascending from +0.0, so a value depends on its own
    row and column alone — never on M, N, the batch, the thread count or the ISA. K steps of
    element-wise work: the spec, not a fast path.
    """
    a32, b32 = a.float(), b.float()
    k = a32.shape[-1]
    if b32.shape[-2] != k:
        raise ValueError(f"matmul: a has K={k} but b is {tuple(b32.shape)}")
    shape = torch.broadcast_shapes(a32.shape[:-2], b32.shape[:-2]) + (a32.shape[-2], b32.shape[-1])
    acc = torch.zeros(shape, dtype=torch.float32, device=a.device)
    for i in range(k):
        acc = fma(a32[..., :, i:i + 1], b32[..., i:i + 1, :], acc)
    return acc


@dataclass(frozen=True)
class Prims:
    """The primitives an implementation supplies to the shared explicit backwards (and to the
    composition's forwards): every implementation of a contract computes these to the same bits."""

    name: str  # implementation name ("reference", "cpu")
    exp: Callable[[torch.Tensor], torch.Tensor]  # strict_exp
    log: Callable[[torch.Tensor], torch.Tensor]  # strict_log
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # GEMM contract, float32 out
    # optional: fold_matmul(acc, a, b, tile) = ((acc + a_0 @ b_0) + a_1 @ b_1) + ... over K tiles of `tile` in order,
    # each product `matmul`'s (from zero): the loop in one call (the Triton backend's kernel); None: the loop
    fold_matmul: Callable | None = None
    # optional: grad_z(hidden, weight, targets, lse, g, temperature, lo, hi) -> dz [T, hi - lo] in weight's dtype, the
    # logprob backward's operand for weight rows [lo, hi) (targets in those rows' numbering) fused with its logits (the
    # Triton backend's kernel): where present, the vocab-parallel backward of a bf16 / fp16 head takes dz from it
    grad_z: Callable | None = None


REFERENCE = Prims("reference", strict_exp, strict_log, matmul)
