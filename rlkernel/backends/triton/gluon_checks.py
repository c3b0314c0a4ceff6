"""What the Gluon kernels (attention_gluon, gemm_gluon) share about where they may serve: the device's architecture
asked once per device, and the first-use check's bookkeeping — run once per key outside a CUDA-graph capture, its
outcome (None: bit-equal to the Triton kernel; else the reason the kernel stays off there) kept for the process and
named in provenance. Each kernel keeps its own caches (the dicts passed in); tests read and set them."""
from __future__ import annotations


def gate_reason(enabled: bool, env: str, import_error: str | None, tested: tuple, checking: list) -> str | None:
    """The checks before any tensor is looked at: switched off by its environment variable, Gluon not importable,
    another Triton than the ones bit-checked, or its first-use check running its Triton side (None: none of these)."""
    if not enabled:
        return f"{env}=0"
    if import_error is not None:
        return f"Gluon unavailable ({import_error})"
    import triton

    if not triton.__version__.startswith(tested):
        return f"Triton {triton.__version__}, checked with {', '.join(tested)}"
    if checking:
        return "first-use check running (its Triton side)"
    return None


def arch_reason(device, cache: dict) -> str | None:
    """None on sm_90 (the architecture the Gluon kernels were bit-checked on), else why not; cache: device index ->
    architecture (golden.gpu_arch), filled once per device."""
    dev = device.index if device.index is not None else -1
    arch = cache.get(dev)
    if arch is None:
        from ...golden import gpu_arch

        arch = cache[dev] = gpu_arch(device)
    return None if arch == "sm_90" else f"{arch}, not sm_90"


def first_use(cache: dict, key, check) -> str | None:
    """cache[key], running check() once to fill it (None while it runs: the check's own first call takes the Gluon
    kernel); inside a CUDA-graph capture (no sync allowed) nothing runs and the Triton kernel serves meanwhile."""
    if key not in cache:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "first-use check pending (a CUDA graph capture)"
        cache[key] = None
        cache[key] = check()
    return cache[key]


def describe_checks(cache: dict, label) -> str:
    """The checks so far for provenance: "; first-use checks: cuda:D <label(key)>: <outcome>; ..." or ""."""
    checks = "; ".join(f"cuda:{k[0]} {label(k)}: {why or 'bit-equal to Triton'}" for k, why in sorted(cache.items()))
    return f"; first-use checks: {checks}" if checks else ""
