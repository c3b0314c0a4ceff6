"""RMSNorm forward in Triton under contracts.RMSNormContract: one row per program, the
whole row in one fixed [BLOCK] layout, config a function of H only."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contracts as C  # noqa: F401  (the contract this module follows: C.RMSNORM)


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
    xf = x.to(tl.float32)
    sq = xf * xf
    ss = tl.sum(sq, axis=0)
    mean = tl.div_rn(ss, H.to(tl.float32))
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    yn = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (yn.to(tl.float32) * w.to(tl.float32)).to(w_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, y, mask=mask)


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
        _rmsnorm_kernel[(rows,)](x2, r2, weight.contiguous(), y, h, H, x2.stride(0), r2.stride(0), y.stride(0),
                                 h.stride(0), float(eps), HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(H),
                                 num_warps=_warps(H), enable_fp_fusion=False)
    y = y.reshape(*x.shape[:-1], H)
    return y if residual is None else (y, h.reshape(x.shape))
