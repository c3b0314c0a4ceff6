"""What the Gluon kernels (attention_gluon, gemm_gluon) share about where they may serve: the device's architecture
asked once per device, and the first-use check's bookkeeping — run once per key outside a CUDA-graph capture, its
outcome (None: bit-equal to the Triton kernel; else the reason the kernel stays off there) kept for the process and
named in provenance. Each kernel keeps its own caches (the dicts passed in); tests read and set them. And their
launches' host-side tensor descriptors (`descriptor`) and their compile for sm_90 without a GPU (`compile_sm90`)."""
from __future__ import annotations

import contextlib

_TD_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")  # Triton 3.6's TensorDescriptor
_TD: list = []  # [the class, whether it has exactly _TD_FIELDS], once


def descriptor(t, shape: list, strides: list, block: list, layout):
    """TensorDescriptor(t, shape, strides, block, layout) for an operand its kernel's gate already found loadable
    through TMA (16-byte aligned base and strides, last dim contiguous: gemm_gluon._aligned, attention._tma_ok),
    built without the constructor's __post_init__ (~1.2 of its ~2.3 us of host time, two or three a launch; the
    checks that remain — rank, block shape, layout type — hold for every descriptor these kernels make). The same
    dataclass with the same field values (tests/test_gemm_gluon.py); a Triton whose TensorDescriptor has other fields
    gets the constructor."""
    if not _TD:
        import dataclasses

        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        _TD.extend((TensorDescriptor, tuple(f.name for f in dataclasses.fields(TensorDescriptor)) == _TD_FIELDS))
    cls, plain = _TD
    if not plain:
        return cls(t, shape, strides, block, layout)
    d = object.__new__(cls)
    d.__dict__.update(base=t, shape=shape, strides=strides, block_shape=block, layout=layout, padding="zero")
    return d


@contextlib.contextmanager
def switched_off(module, flag: str = "_ENABLED"):
    """Within: `module.flag` is False (a kernel switched off in this process, as its environment variable does); the
    process's setting comes back after, also on an exception. Behind gemm_gluon.off, attention_gluon.off and
    attention.tma_off (the reference sides of the benchmarks and tests that compare two kernels' bits)."""
    saved = getattr(module, flag)
    setattr(module, flag, False)
    try:
        yield
    finally:
        setattr(module, flag, saved)


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


def compile_sm90(kernel, sig: dict, const: dict, attrs: dict | None = None, **options):
    """A Gluon kernel compiled for sm_90 here, with no GPU (Triton ships ptxas): `sig` its runtime arguments' types,
    `const` its constexprs (typed "constexpr" in the signature), `attrs` Triton's argument attributes (alignment),
    `options` the compile's (num_warps, num_ctas). The CompiledKernel (tests, the scripts' --compile-only)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(kernel, {**sig, **{k: "constexpr" for k in const}}, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
