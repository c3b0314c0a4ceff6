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
import logging
import os
import threading
import time
import warnings

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
    "write_kv_supported": "attention",
    "linear_logprob": "logprob",
}

__all__ = ["available", "unavailable_reason", "status", "GoldenCheckError", "contracts", *_LAZY]

GOLDEN_ENV = "RLKERNEL_GPU_GOLDEN"  # check (default) | warn | off: the first use's golden-bits check
log = logging.getLogger(__name__)
_GOLDEN = {"result": None, "failed": None, "seconds": None}  # the check's outcome in this process (one per process: one GPU kind)
_REASON: list = []  # [unavailable reason or None], once a process
_LOCK = threading.RLock()


class GoldenCheckError(RuntimeError):
    """The Triton kernels compute other bits on this GPU than the golden hashes committed for its architecture."""


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not (no triton, no torch, no CUDA device, or this GPU's bits
    differ from its committed golden hashes). Decided once a process: the dispatcher asks at every op call, and two
    module lookups and a device query took ~40 us a call (~11 ms an eager 0.6B forward)."""
    if _GOLDEN["failed"]:
        return _GOLDEN["failed"]
    if not _REASON:
        _REASON.append(_environment_reason())
    return _REASON[0]


def _environment_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def available() -> bool:
    """Whether the kernels run here: triton, torch and a CUDA device, and (at the first call in a process) the golden
    slice reproduced on this GPU's architecture where hashes are committed (`rlkernel.golden.gpu_self_check`).
    Raises GoldenCheckError, then and on every later call, when the bits differ (RLKERNEL_GPU_GOLDEN=check): never
    a quiet False, which would let the dispatcher pick another implementation with other bits."""
    if _GOLDEN["failed"]:
        raise GoldenCheckError(_GOLDEN["failed"])
    return unavailable_reason() is None and _golden_ok()


def _golden_ok() -> bool:
    if _GOLDEN["result"] is None:
        _golden_check()
    if _GOLDEN["failed"]:
        raise GoldenCheckError(_GOLDEN["failed"])
    return True


def _golden_check() -> None:
    with _LOCK:
        if _GOLDEN["result"] is not None:
            return  # done, or running: its cases resolve this backend again
        mode = os.environ.get(GOLDEN_ENV, "check")
        if mode not in ("check", "warn", "off"):
            raise ValueError(f"{GOLDEN_ENV}={mode!r}: use check, warn or off")
        if mode == "off":
            _GOLDEN["result"] = f"off ({GOLDEN_ENV}=off)"
            return
        _GOLDEN["result"] = "running"
        from ... import golden

        t0 = time.perf_counter()
        try:
            _GOLDEN["result"] = golden.gpu_self_check()
            _GOLDEN["seconds"] = round(time.perf_counter() - t0, 2)
            # once a process, and it compiles kernels: say what the start-up time went to
            log.warning("rlkernel: Triton kernels' golden-bits check at first use: %s (%.1f s)", _GOLDEN["result"],
                        _GOLDEN["seconds"])
        except golden.GoldenMismatch as e:
            msg = (f"rlkernel: {e}. Rollout and trainer running these same versions still agree with each other, but "
                   f"not with the recorded bits; set {GOLDEN_ENV}=warn to run anyway (recorded in provenance)")
            _GOLDEN["result"] = f"differs ({mode}): {e}"
            _GOLDEN["seconds"] = round(time.perf_counter() - t0, 2)
            if mode == "check":
                _GOLDEN["failed"] = msg
            else:
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        except Exception:
            _GOLDEN["result"] = None  # not a verdict (e.g. out of memory): the next call tries again
            raise


def status() -> dict:
    """What the Triton implementation did in this process (for run provenance): the golden check's outcome, its
    duration and its setting; None where it has not run."""
    return {"golden": _GOLDEN["result"], "golden_seconds": _GOLDEN["seconds"], GOLDEN_ENV: os.environ.get(GOLDEN_ENV, "check"),
            "unavailable": unavailable_reason(), "attention_prefill_gluon": _gluon("attention_gluon"),
            "gemm_gluon": _gluon("gemm_gluon")}


def _gluon(module: str) -> str | None:
    """Whether this process may run a Gluon kernel module's kernels (its `describe()`; None without triton)."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module(f"{__name__}.{module}").describe()


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


from . import ops as _ops  # noqa: E402,F401  (registers the "triton" implementation with dispatch; imports no triton)
