"""The native implementations: torch's production ops, under the native contracts.

What this module decides: what "native" means in every ablation (the P side of the P/R
matrix) and in every negative control — F.linear (MKL/oneDNN/cuBLAS), F.rms_norm, F.silu,
HF's RoPE formula, scaled_dot_product_attention, log_softmax. Nothing here is strict.
Packed (varlen) causal attention on CUDA in half precision runs torch's varlen flash attention
(`torch.nn.attention.varlen.varlen_attn`, forward and backward in one call each), the kernel a
production trainer uses; elsewhere, and where that API is missing, SDPA per request.
"""
from __future__ import annotations

import functools
import inspect
import math

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


@functools.cache
def _varlen_api():
    """torch's varlen flash attention and the keywords its version takes (None where torch has none). Shapes seen:
    (..., max_q, max_k, is_causal=...) without GQA; torch 2.11's (..., *, scale, window_size) without GQA; and later
    ones that add enable_gqa."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen(q, k, v, cu_seqlens, scale, api=None, max_len=None):
    """Packed causal attention by torch's varlen flash attention, or None where it does not apply (not CUDA, not
    half precision, no such API, or an API without a `scale` for a non-default scale). `api`: (fn, its keywords);
    `max_len`: the host's bound on the longest sequence (as Megatron passes flash attention its max_seqlen), else
    read back here."""
    api = api or _varlen_api()
    if api is None or q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    fn, params = api
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    default = scale is None or math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6)
    if "window_size" not in params and ("is_causal" not in params or not (default or "scale" in params)):
        return None
    groups = q.shape[1] // k.shape[1]
    kw = {} if default and "scale" not in params else {"scale": scale}
    if groups > 1 and "enable_gqa" in params:
        kw["enable_gqa"] = True
    elif groups > 1:  # an API without GQA: the key/value heads repeated
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:  # (-1, 0): every earlier key, no later one
        return fn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **kw)
    return fn(q, k, v, cu, cu, max_len, max_len, is_causal=True, **kw)


@dispatch.register("attention", "native", c_attention.NATIVE)
def attention(kind, *args, max_query_len=None, max_seq_len=None):
    if kind == "varlen":
        out = flash_varlen(*args, max_len=max_query_len)
        if out is not None:
            return out
    return (varlen if kind == "varlen" else paged)(_sdpa, *args)


@dispatch.register("linear_logprob", "native", c_logprob.NATIVE)
def linear_logprob(kind, hidden, weight, targets, temperature, vocab_size):
    logits = F.linear(hidden, weight[:vocab_size]).float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    if kind == "entropy":
        return -(lp.exp() * lp).sum(-1)
    return lp if kind == "full" else lp.gather(1, targets[:, None])[:, 0]
