"""rlkernel's GPU backend: Triton kernels that follow declared GPU contracts.

Importing this package is cheap and safe everywhere: `contracts` is plain data, and the
kernel modules (which import torch and triton) load on first attribute access. On a
machine without triton, or without CUDA, `available()` says so and the kernels are not
touched. Public API (each takes and returns torch tensors on a CUDA device):

    matmul(a, weight=None, *, b=None, out_dtype=None)        GEMM, batch-invariant
    matmul_swiglu(x, gate_up_weight)                         GEMM + fused SwiGLU epilogue
    swiglu(gate, up)                                         the epilogue alone, same bits
    rms_norm(x, weight, eps=1e-6, residual=None)             RMSNorm forward
    attention_varlen(q, k, v, cu_seqlens, *, scale=None)     packed causal prefill
    attention_paged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None)
    linear_logprob(hidden, weight, targets, temperature=1.0, *, vocab_size=None)
"""
from __future__ import annotations

import importlib
import importlib.util

from . import contracts

_LAZY = {
    "matmul": "gemm",
    "matmul_swiglu": "gemm",
    "swiglu": "gemm",
    "rms_norm": "norm",
    "attention_varlen": "attention",
    "attention_paged": "attention",
    "attention_varlen_backward": "attention_bwd",
    "write_kv_cache": "attention",
    "linear_logprob": "logprob",
}

__all__ = ["available", "unavailable_reason", "contracts", *_LAZY]


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not (no triton, no torch, no CUDA device)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def available() -> bool:
    return unavailable_reason() is None


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


from . import ops as _ops  # noqa: E402,F401  (registers the "triton" implementation with dispatch; imports no triton)
