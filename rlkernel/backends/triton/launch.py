"""Kernel launches with less host time: what a strict update on the GPU waits for is the host (session 23's cProfile of
one Qwen3-0.6B-shaped update: 1,305 Triton launches, `JITFunction.run` 86 of the update's 345 ms of profiled host
time, and 2,216 host calls of `triton.cdiv` / `triton.next_power_of_2`, which are Triton `constexpr_function`s in 3.6).

`fast(kernel)` wraps a `@triton.jit` kernel so that `fast(kernel)[grid](*args, **kwargs)` launches the same compiled
kernel Triton's own `kernel[grid](...)` would, with less Python on the way:
- Triton's own binder (`device_caches[device]`: the generated function that binds the arguments and computes their
  specialization, its native part included) gives (bound arguments, specialization, options), exactly as in
  `JITFunction.run`; our key is (device, the specialization, the options) — Triton's own cache key is made of these too,
  plus the debug and instrumentation options it adds itself (`knobs.runtime.debug`, `knobs.compilation.
  instrumentation_mode`), so a key of ours maps to one of Triton's kernels while those two stay as they were when the
  key was filled. rlkernel never changes them; reading them costs ~4 us (environment lookups), so a hit does not:
  code that changes either after kernels have run calls `reset()` (or runs with RLKERNEL_TRITON_FAST_LAUNCH=0).
- A key seen for the first time launches through `JITFunction.run` (compiling if needed) and keeps the kernel it
  returns; later calls launch that kernel directly (`CompiledKernel.run`), skipping Triton's string cache key, its
  launch-metadata dict and its hook calls.
- Launch hooks (a profiler such as proton registers `knobs.runtime.launch_enter_hook`), another Triton than the
  tested 3.6, the interpreter (`TRITON_INTERPRET=1`), or `RLKERNEL_TRITON_FAST_LAUNCH=0` all take Triton's own path.
A Gluon kernel (`@gluon.jit`, attention_gluon's prefill) is a JITFunction too and takes the same path: its
TensorDescriptor arguments reach the compiled kernel's launcher as Triton's own `run` passes them (the launcher encodes
their tensor maps at each launch either way).
Which kernel runs, and so every bit, is Triton's choice either way: `verify` launches through both paths and checks
that they pick the same compiled kernel (tests/test_triton_launch.py on a GPU, `scripts/gpu_session.py gpu_tests`).

`cdiv` and `next_pow2` are the host-side integer helpers (plain Python).
"""
from __future__ import annotations

import contextlib
import os
import time

FAST_ENV = "RLKERNEL_TRITON_FAST_LAUNCH"
TESTED_TRITON = ("3.6",)  # the Triton minor versions whose JITFunction / CompiledKernel internals this was checked on


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter here (TRITON_INTERPRET set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints (triton.cdiv's value, without its constexpr_function wrapper)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (triton.next_power_of_2's value there)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_STATE: dict = {}  # "ok": whether the fast path may serve in this process (decided once); "device", "stream": their getters


def _fast_ok() -> bool:
    ok = _STATE.get("ok")
    if ok is None:
        ok = False
        try:
            import triton
            from triton import knobs
            from triton.runtime.jit import JITFunction  # noqa: F401 -- the class whose internals the fast path reads

            ok = (os.environ.get(FAST_ENV, "1") != "0" and not interpreting()
                  and triton.__version__.startswith(TESTED_TRITON) and hasattr(knobs, "runtime"))
            if ok:  # the current device and stream as Triton's own launch reads them (torch's)
                from triton.runtime.driver import driver

                _STATE["device"] = driver.active.get_current_device
                _STATE["stream"] = driver.active.get_current_stream
        except Exception:  # noqa: BLE001 -- no triton, or another layout: Triton's own path
            ok = False
        _STATE["ok"] = ok
    return ok


@contextlib.contextmanager
def fast_path(enabled: bool):
    """Within the block, rlkernel's kernels launch through the fast path (enabled) or through Triton's own launch
    (benchmarks compare the two in one process); the process's choice is restored after. Enabling where the fast path
    cannot serve (the interpreter, another Triton, RLKERNEL_TRITON_FAST_LAUNCH=0) raises."""
    if enabled and not _fast_ok():
        raise RuntimeError("the fast launch path cannot serve in this process (interpreter, another Triton, or turned off)")
    before = _STATE.get("ok")
    _STATE["ok"] = enabled
    try:
        yield
    finally:
        if before is None:
            _STATE.pop("ok", None)
        else:
            _STATE["ok"] = before


# kernels this process launched for the first time through the fast path (Triton compiled them, or loaded them from its
# disk cache) and the wall seconds those first launches took: what a cold machine's first step spends compiling
_FIRST = {"launches": 0, "seconds": 0.0}


def first_launch_stats() -> dict:
    """{"launches", "seconds"}: first launches of a (kernel, specialization) in this process on the fast path, and their
    wall time (a compile, or a load from Triton's disk cache, plus the launch). Kernels that take Triton's own path
    (interpreter, hooks, RLKERNEL_TRITON_FAST_LAUNCH=0) are not counted."""
    return dict(_FIRST)


_DEFAULT_OPTIONS = (False, "")  # (debug, instrumentation mode) under which kernels are cached: Triton's defaults
_CACHES: set = set()  # the FastKernels holding cached kernels (reset() empties them)


def reset() -> None:
    """Forget every cached kernel (after changing Triton's debug or instrumentation knobs in a running process)."""
    for k in list(_CACHES):
        k._kernels.clear()
    _CACHES.clear()


def _options_now() -> tuple:
    from triton import knobs

    return bool(knobs.runtime.debug), knobs.compilation.instrumentation_mode


def _hooks_active() -> bool:
    from triton import knobs

    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # a HookChain with calls, or any other hook object
            return True
    return False


class FastKernel:
    """A `@triton.jit` kernel with `[grid](...)` on the fast path (module docstring). Every other attribute is the
    kernel's own (`fn`), so the wrapper can stand where the kernel stood."""

    def __init__(self, fn):
        self.fn = fn
        self._kernels: dict = {}
        self._jit = hasattr(fn, "device_caches")  # a JITFunction (the interpreter's InterpretedFunction has none)

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        if not (self._jit and _fast_ok()):
            return self.fn[grid]
        return lambda *args, **kwargs: self._run(grid, args, kwargs)

    def _bind(self, args, kwargs):
        device = _STATE["device"]()
        caches = self.fn.device_caches[device]  # (kernel cache, key cache, target, backend, binder): Triton's own
        bound, spec, options = caches[4](*args, **kwargs)
        return device, bound, (device, tuple(spec), tuple(options.items()))

    def _run(self, grid, args, kwargs):
        try:
            device, bound, key = self._bind(args, kwargs)
            kernel = self._kernels.get(key)
        except TypeError:  # an unhashable specialization value: Triton's own path
            return self.fn[grid](*args, **kwargs)
        if kernel is None or _hooks_active():
            first = kernel is None
            t0 = time.perf_counter()
            kernel = self.fn[grid](*args, **kwargs)  # launches (compiling if needed) and returns the kernel it ran
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if kernel is not None and not _hooks_active() and _options_now() == _DEFAULT_OPTIONS:
                if first:  # counted once per cached key (under hooks every launch comes here and none is cached)
                    _FIRST["launches"] += 1
                    _FIRST["seconds"] += time.perf_counter() - t0
                self._kernels[key] = kernel
                _CACHES.add(self)
            return kernel
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        stream = _STATE["stream"](device)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
                   kernel.packed_metadata, None, None, None, *bound.values())
        return kernel

    def verify(self, grid, *args, **kwargs) -> dict:
        """Launch through the fast path and through Triton's own, and say whether both ran the same compiled kernel
        (the object Triton's cache holds for these arguments). Runs the kernel up to three times: use scratch outputs."""
        first = self[grid](*args, **kwargs)  # fills our cache on a new key
        fast = self[grid](*args, **kwargs)  # served from it
        own = self.fn[grid](*args, **kwargs)
        return {"fast_path": _fast_ok(), "cached": self._bind(args, kwargs)[2] in self._kernels,
                "same_kernel": fast is own and first is own}


def fast(fn) -> FastKernel:
    """`fn` (a @triton.jit kernel) launched on the fast path; under the interpreter or elsewhere Triton's own."""
    return fn if isinstance(fn, FastKernel) else FastKernel(fn)
