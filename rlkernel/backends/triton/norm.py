"""RMSNorm forward in Triton under contracts.RMSNormContract: one row per program, the
whole row in one fixed [BLOCK] layout, config a function of H only."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contracts as C  # noqa: F401  (the contract this module follows: C.RMSNORM)
from .launch import fast, next_pow2


@triton.jit
def _row_rstd(xf, n, eps):
    """1 / sqrt(sum(x^2) / n + eps) of one fp32 row: tl.sum over the row's [BLOCK] layout, IEEE divides and sqrt."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(xf * xf, axis=0), n) + eps))


@triton.jit
def _normed(x, rstd, w):
    """x * rstd rounded to x's dtype, then times w rounded to w's dtype (the contract's rounding points)."""
    return ((x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(w.dtype)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, H, sx, sr, sy, sh, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * sh + cols, x, mask=mask)
    rstd = _row_rstd(x.to(tl.float32), H.to(tl.float32), eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * sy + cols, _normed(x, rstd, w), mask=mask)


def _warps(h: int) -> int:
    return 8 if h >= 4096 else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim (x [..., H]); with `residual` returns (normed, x + residual)."""
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match H={H}")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, H), device=x.device, dtype=weight.dtype)
    if residual is not None:
        r2 = residual.reshape(-1, H)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        h = torch.empty_like(x2)
    else:
        r2, h = x2, x2
    if rows:
        _rmsnorm_kernel_fast[(rows,)](x2, r2, weight.contiguous(), y, h, H, x2.stride(0), r2.stride(0), y.stride(0),
                                 h.stride(0), float(eps), HAS_RES=residual is not None, BLOCK=next_pow2(H),
                                 num_warps=_warps(H), enable_fp_fusion=False)
    y = y.reshape(*x.shape[:-1], H)
    return y if residual is None else (y, h.reshape(x.shape))


@triton.jit
def _rmsnorm_bwd_kernel(h_ptr, w_ptr, gy_ptr, gho_ptr, gx_ptr, pw_ptr, H, sh, sgy, sgho, sgx, eps,
                        HAS_GHO: tl.constexpr, BLOCK: tl.constexpr):
    """One row: dh = rstd * (gy*w - xhat * mean(gy*w*xhat)) (+ the residual stream's gradient),
    and the row's share of dw, g * (the normalised row the forward multiplied by w), in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(h_ptr + row * sh + cols, mask=mask, other=0.0)
    hf = h.to(tl.float32)
    rstd = _row_rstd(hf, H.to(tl.float32), eps)
    xhat = hf * rstd
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + row * sgy + cols, mask=mask, other=0.0).to(tl.float32)
    gyw = gy * w
    dot = tl.div_rn(tl.sum(gyw * xhat, axis=0), H.to(tl.float32))
    gh = rstd * (gyw - xhat * dot)
    if HAS_GHO:
        gh = gh + tl.load(gho_ptr + row * sgho + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(gx_ptr + row * sgx + cols, gh.to(gx_ptr.dtype.element_ty), mask=mask)
    normed = xhat.to(h_ptr.dtype.element_ty).to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(pw_ptr + row * H + cols, gy * normed, mask=mask)


def rms_norm_backward(h: torch.Tensor, weight: torch.Tensor, gy: torch.Tensor, eps: float,
                      gh_out: torch.Tensor | None = None):
    """(dx, dw_rows) of RMSNorm from its input h (x, or x + residual), the weight and dy; dw_rows
    [rows, H] float32 are the per-row shares of dw (the caller reduces them in a fixed order).
    Deterministic: one program per row, fixed layouts."""
    H = h.shape[-1]
    h2 = h.reshape(-1, H).contiguous()
    gy2 = gy.reshape(-1, H).contiguous()
    rows = h2.shape[0]
    gx = torch.empty_like(h2)
    pw = torch.empty((rows, H), device=h.device, dtype=torch.float32)
    gho = gh_out.reshape(-1, H).contiguous() if gh_out is not None else gy2
    if rows:
        _rmsnorm_bwd_kernel_fast[(rows,)](h2, weight.contiguous(), gy2, gho, gx, pw, H, h2.stride(0), gy2.stride(0),
                                     gho.stride(0), gx.stride(0), float(eps), HAS_GHO=gh_out is not None,
                                     BLOCK=next_pow2(H), num_warps=_warps(H), enable_fp_fusion=False)
    return gx.reshape(h.shape), pw


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, sxt, sxh, syt, syh, eps,
                      D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One (token, head) row per program: `_rmsnorm_kernel`'s row (the same [BLOCK] layout, `_row_rstd` and `_normed`),
    then `rope._rope_kernel`'s rotation of it. The partner element of each column (j + D/2 or j - D/2) is normalised
    again from its own load with the row's rstd: the same element-wise arithmetic, so the same bits as the norm's
    output there."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    row = x_ptr + t * sxt + h * sxh
    x = tl.load(row + cols, mask=mask, other=0.0)
    rstd = _row_rstd(x.to(tl.float32), D * 1.0, eps)
    y = _normed(x, rstd, tl.load(w_ptr + cols, mask=mask, other=0.0))
    low = cols < HALF
    part = tl.where(low, cols + HALF, cols - HALF)
    yp = _normed(tl.load(row + part, mask=mask, other=0.0), rstd, tl.load(w_ptr + part, mask=mask, other=0.0))
    p = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.where(low, cols, cols - HALF)
    c = tl.load(cos_ptr + p * HALF + j, mask=mask, other=0.0)
    s = tl.load(sin_ptr + p * HALF + j, mask=mask, other=0.0)
    yf, ypf = y.to(tl.float32), yp.to(tl.float32)
    out = tl.where(low, yf * c - ypf * s, yf * c + ypf * s)  # x1*c - x2*s | x2*c + x1*s, as the rope kernel
    tl.store(y_ptr + t * syt + h * syh + cols, out.to(y_ptr.dtype.element_ty), mask=mask)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """`rope.forward(rms_norm(x, weight, eps), positions, cos, sin)` in one launch: x [T, heads, D] (any strides but a
    contiguous last dim: a q or k view of the fused qkv output, no copy), weight [D] -> [T, heads, D] in weight.dtype."""
    if x.dim() != 3 or positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"norm_rope: x must be [T, H, D] with positions [T], got {tuple(x.shape)} and {tuple(positions.shape)}")
    t, h, d = x.shape
    if weight.shape != (d,) or d % 2 or cos.shape[-1] != d // 2 or sin.shape[-1] != d // 2:
        raise ValueError(f"norm_rope: weight {tuple(weight.shape)} / tables of width {cos.shape[-1]} do not match head_dim {d}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((t, h, d), dtype=weight.dtype, device=x.device)
    if t and h:
        _norm_rope_kernel_fast[(t, h)](x, weight.contiguous(), positions.contiguous(), cos.contiguous(), sin.contiguous(), y,
                                  x.stride(0), x.stride(1), y.stride(0), y.stride(1), float(eps), D=d, HALF=d // 2,
                                  BLOCK=next_pow2(d), num_warps=_warps(d), enable_fp_fusion=False)
    return y

# the launches on launch.py's fast path: the kernels Triton's own kernel[grid](...) would run, less host time
_rmsnorm_kernel_fast = fast(_rmsnorm_kernel)
_rmsnorm_bwd_kernel_fast = fast(_rmsnorm_bwd_kernel)
_norm_rope_kernel_fast = fast(_norm_rope_kernel)
