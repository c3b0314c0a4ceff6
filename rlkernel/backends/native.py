"""The native implementations: torch's production ops, under the native contracts.

What this module decides: what "native" means in every ablation (the P side of the P/R
matrix) and in every negative control — F.linear (MKL/oneDNN/cuBLAS), F.rms_norm, F.silu,
HF's RoPE formula, scaled_dot_product_attention, log_softmax. Nothing here is strict.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ..contracts import attention as c_attention
from ..contracts import gemm as c_gemm
from ..contracts import logprob as c_logprob
from ..contracts import norm as c_norm
from ..contracts import rope as c_rope
from ..contracts import swiglu as c_swiglu
from .reference.attention import expand_kv, paged, varlen


@dispatch.register("linear", "native", c_gemm.NATIVE)
def linear(x, weight, bias=None, k_segments: int = 1):
    return F.linear(x, weight, bias)


@dispatch.register("rms_norm", "native", c_norm.NATIVE)
def rms_norm(x, weight, eps, residual=None):
    h = x if residual is None else x + residual
    y = F.rms_norm(h, (h.shape[-1],), weight, eps)
    return y if residual is None else (y, h)


@dispatch.register("swiglu", "native", c_swiglu.NATIVE)
def swiglu(gate, up):
    return F.silu(gate) * up


@dispatch.register("rope", "native", c_rope.NATIVE)
def rope(x, positions, theta, max_position=None):
    d = x.shape[-1]
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    n = max_position if max_position is not None else (int(positions.max()) + 1 if positions.numel() else 1)
    ang = torch.arange(n, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    c = emb.cos()[positions].to(x.dtype).unsqueeze(-2)
    s = emb.sin()[positions].to(x.dtype).unsqueeze(-2)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * c + rot * s


def _sdpa(q, qpos, k, v, scale):
    b, n, hq, d = q.shape
    last = int(qpos.max()) + 1
    groups = hq // k.shape[2]
    kk, vv = expand_kv(k[:, :last], groups), expand_kv(v[:, :last], groups)
    mask = torch.arange(last, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, n, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


@dispatch.register("attention", "native", c_attention.NATIVE)
def attention(kind, *args, max_query_len=None, max_seq_len=None):
    return (varlen if kind == "varlen" else paged)(_sdpa, *args)


@dispatch.register("linear_logprob", "native", c_logprob.NATIVE)
def linear_logprob(kind, hidden, weight, targets, temperature, vocab_size):
    logits = F.linear(hidden, weight[:vocab_size]).float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    if kind == "entropy":
        return -(lp.exp() * lp).sum(-1)
    return lp if kind == "full" else lp.gather(1, targets[:, None])[:, 0]
