"""The C++ implementation of the strict contracts on the CPU ("cpu").

What this package decides: whether the kernels in csrc/ serve strict ops in this process.
They compute the reference composition's bits (backends/reference) in one call per op —
an implementation choice, never a contract change: a rollout engine running these kernels
and a trainer running the composition still agree bitwise. Before they serve anything the
library must build, its compiled-in constants must equal rlkernel/contracts, and a slice of
the golden suite (rlkernel/golden.py) must reproduce the committed hashes; a failed *build*
leaves the composition serving (same bits, slower: a warning and the provenance say so), a
failed *check* raises (wrong bits are never served). `RLKERNEL_CPU_KERNELS=0` turns the kernels
off. Training forwards run the kernels inside the shared autograd functions, whose explicit
backwards run on these kernels' GEMM (`mm`) and exp.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref

import torch

from ... import dispatch
from ...contracts import attention as c_attention
from ...contracts import gemm as c_gemm
from ...contracts import logprob as c_logprob
from ...contracts import norm as c_norm
from ...contracts import primitives as c_prims
from ...contracts import rope as c_rope
from ...contracts import swiglu as c_swiglu
from ..reference import attention, linear, logprob, norm, rope, swiglu
from ..reference.primitives import Prims
from . import build as _build

__all__ = ["available", "status", "CPU", "SelfCheckError"]

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict = {"loaded": None, "error": None, "path": None, "checked": None}


class SelfCheckError(RuntimeError):
    """The built kernels do not reproduce the contract's bits on this machine."""


def _ops():
    return torch.ops.rlkernel


def _check_constants() -> None:
    got = _ops().constants().tolist()
    want = [c_attention.ATTN_CHUNK, c_logprob.VOCAB_TILE, c_prims.LOG2E, c_prims.LN2_HI, c_prims.LN2_LO, c_prims.EXP_MIN,
            c_prims.EXP_MAX, *c_prims.EXP_C]
    # the C++ holds float32 copies (kChunk/kVocabTile exact): compare after rounding to float32
    want32 = torch.tensor(want, dtype=torch.float64).float().double().tolist()
    if got != want32:
        raise SelfCheckError(f"rlkernel CPU kernels: compiled-in constants {got} differ from rlkernel/contracts {want32}")


def _load() -> bool:
    if _STATE["loaded"] is not None:
        return _STATE["loaded"]
    with _LOCK:
        if _STATE["loaded"] is not None:
            return _STATE["loaded"]
        if os.environ.get("RLKERNEL_CPU_KERNELS", "1") == "0":
            _STATE.update(loaded=False, error="RLKERNEL_CPU_KERNELS=0")
            return False
        try:
            _STATE["path"] = str(_build.build())
        except Exception as e:  # a missing compiler or a failed build: the composition serves
            _STATE.update(loaded=False, error=f"build failed: {type(e).__name__}: {e}")
            warnings.warn(f"rlkernel: CPU kernels off ({_STATE['error']}); the reference composition serves the strict ops "
                          "(same bits, slower)", RuntimeWarning, stacklevel=3)
            return False
        try:
            _check_constants()
            from ... import golden

            _STATE["loaded"] = True  # provisionally: the golden slice runs through the kernels
            _STATE["checked"] = golden.self_check("cpu")  # raises GoldenMismatch naming the cases
        except Exception as e:
            _STATE.update(loaded=False, error=f"self-check failed: {e}")
            raise SelfCheckError(f"rlkernel: the CPU kernels at {_STATE['path']} fail their load-time check: {e}") from e
        return True


def available() -> bool:
    """Whether the kernels are built, loaded and self-checked in this process (builds if needed)."""
    return _load()


def status() -> dict:
    """What the CPU implementation does in this process (for run provenance); loads first."""
    try:
        loaded = _load()
    except SelfCheckError:
        loaded = False
    return {"cpu_kernels": bool(loaded), "library": _STATE["path"], "march": _build.march(), "error": _STATE["error"],
            "self_check": _STATE["checked"]}


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The GEMM contract through the kernel: a [..., M, K], b [K, N] or [..., K, N] -> fp32."""
    if a.dim() == 2 and b.dim() == 2:
        return _ops().matmul(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    # one kernel call per batch item, looped in C++ (the bits of per-item rlkernel::matmul calls)
    out = _ops().bmm(a3, b3) if a3.shape[0] else a3.new_zeros(0, a.shape[-2], b.shape[-1]).float()
    return out.reshape(*batch, a.shape[-2], b.shape[-1])


CPU = Prims("cpu", lambda x: _ops().exp(x.float()), lambda x: _ops().log(x.float()), _matmul)


# Weights packed for the GEMM kernel (panels of 16 output columns), kept per weight tensor while
# it lives and re-packed when it changes (its version counter moves on every in-place update,
# e.g. a weight sync or an optimizer step; a write through `.data` does not move it, which is why
# only callers that opt in with rk.mode(pack_weights=True) get packing: the vLLM model and the
# trainer's scoring). Packing moves data only: the bits are those of the unpacked call
# (tests/test_cpu_kernels.py). key: id(weight) -> (ref, version, data_ptr, what, packs)
_PACKED: dict[int, tuple] = {}


def _packed(weight: torch.Tensor, what: tuple, make) -> object | None:
    """`make(weight)`'s packing of `weight`, cached while the weight is alive and unchanged;
    None unless the policy allows packed weights, and for tensors without a version counter
    (inference tensors)."""
    if not dispatch.current_policy().pack_weights:
        return None
    try:
        version = weight._version
    except RuntimeError:
        return None
    key = id(weight)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is weight and hit[1:4] == (version, weight.data_ptr(), what):
        return hit[4]
    packs = make(weight)
    _PACKED[key] = (weakref.ref(weight, lambda _, key=key: _PACKED.pop(key, None)), version, weight.data_ptr(), what, packs)
    return packs


def _linear_fwd(x, weight, bias, k_segments):
    seg = weight.shape[1] // k_segments
    packs = _packed(weight, ("linear", k_segments, tuple(weight.shape), weight.dtype),
                    lambda w: [_ops().pack_b(w[:, i * seg:(i + 1) * seg].t()) for i in range(k_segments)])
    segs = f", {k_segments} K segments" if k_segments > 1 else ""
    if packs is None:
        dispatch.note_kernel(lambda: "cpu gemm" + segs)
        return _ops().linear(x, weight, bias, k_segments)
    dispatch.note_kernel(lambda: "cpu gemm, packed weight" + segs)
    return _ops().linear_packed(x, packs, weight.shape[0], bias)


def _linear(x, weight, bias=None, k_segments: int = 1):
    return linear.linear(x, weight, bias, k_segments, prims=CPU, fwd=_linear_fwd)


def _rms_norm(x, weight, eps, residual=None):
    return norm.rms_norm(x, weight, eps, residual, fwd=lambda *a: tuple(_ops().rms_norm(*a)))


def _swiglu(gate, up):
    return swiglu.swiglu(gate, up, prims=CPU, fwd=_ops().swiglu)


def _rope(x, positions, theta, max_position=None):
    return rope.rope(x, positions, theta, fwd=_ops().rope, max_position=max_position)


def _attention(kind, q, k, v, *args, max_query_len=None, max_seq_len=None):
    dispatch.note_kernel(lambda: f"cpu attention {kind}")
    return attention.attention(kind, q, k, v, *args, prims=CPU, fwd_lse=lambda *a: tuple(_ops().attention_varlen_lse(*a)),
                               fwd_paged=_ops().attention_paged)


def _lm_head(weight, vocab_size):
    return _packed(weight, ("lm_head", vocab_size, tuple(weight.shape), weight.dtype), lambda w: _ops().pack_b(w[:vocab_size].t()))


def _targets_lse(hidden, weight, targets, temperature, vocab_size):
    both = _ops().logprob_targets_lse(hidden, weight, _lm_head(weight, vocab_size), targets, temperature, vocab_size)
    return both[0], both[1]


def _lse(hidden, weight, temperature, vocab_size):
    return _ops().logsumexp(hidden, weight, _lm_head(weight, vocab_size), temperature, vocab_size)


def _full(hidden, weight, temperature, vocab_size):
    return _ops().logprobs_full(hidden, weight, _lm_head(weight, vocab_size), temperature, vocab_size)


def _linear_logprob(kind, hidden, weight, targets, temperature, vocab_size):
    return logprob.linear_logprob(kind, hidden, weight, targets, temperature, vocab_size, prims=CPU,
                                  fwd_targets_lse=_targets_lse, fwd_lse=_lse, fwd_full=_full)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> bool:
    """Copy k/v into the caches with the kernel where it serves this layout; False where it does not."""
    if not (k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
            and dispatch.resolve("attention", k_cache.device, "strict").name == "cpu"):
        return False
    _ops().write_kv(k, v, k_cache, v_cache, slot_mapping)
    return True


for _op, _contract, _fn in (("linear", c_gemm.STRICT, _linear), ("rms_norm", c_norm.STRICT, _rms_norm), ("swiglu", c_swiglu.STRICT, _swiglu),
                            ("rope", c_rope.STRICT, _rope), ("attention", c_attention.STRICT, _attention),
                            ("linear_logprob", c_logprob.STRICT, _linear_logprob)):
    dispatch.register(_op, "cpu", _contract, devices=("cpu",), available=available, prims=CPU)(_fn)
