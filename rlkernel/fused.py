"""Fused CPU kernels for the reference contracts: same bits, fewer passes.

What this module decides: whether a reference-backend op on the CPU runs as its
torch composition or as one call into `csrc/strict_cpu.cpp`. Both compute the
same contract to the bit (the C++ repeats the composition's IEEE operations in
its order; tile GEMMs are the same `at::bmm` calls), so this is an
implementation choice, never a contract change: a rollout engine running the
fused kernels and a trainer running the composition still agree bitwise
(tests/test_fused_cpu.py checks every kernel with torch.equal).

The library is compiled on first use (about a minute, once per machine; `make
install` does it ahead) into `$RLKERNEL_BUILD_DIR` or `~/.cache/rlkernel`,
keyed by the source, torch and CPU flags. Before a kernel whose order mirrors
the BLAS tile GEMM (attention) serves a head size, it is checked against the
composition on random data on this machine; a failed check or a failed build
turns the fused path off with one warning, and the composition runs (same
contract, slower). `RLKERNEL_FUSED=0` turns it off; `status()` says what ran,
for provenance.

The fused path serves calls that need no autograd graph (rollout, scoring,
old-logprob passes); training forwards keep the composition and its backward.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["available", "active", "route", "disabled", "status", "build", "ops", "attention_ok", "plain_gemm_ok"]

log = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "strict_cpu.cpp"
_LOCK = threading.Lock()
_STATE: dict = {"loaded": None, "error": None, "path": None, "attention_checks": {}, "gemm_checks": {}}
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("rlkernel_fused_off", default=False)
# Longest K for which the BLAS fp32 tile GEMM is one fused-multiply-add chain (measured on
# this CPU's MKL: K <= 192; K = 256 splits in two). Attention's q.k has K = head_dim.
# Below 16 the BLAS takes another path (measured: head_dim 8 differs), so the fused kernel
# serves 16 <= head_dim <= 192 and the composition the rest.
MAX_FUSED_HEAD_DIM = 192
MIN_FUSED_HEAD_DIM = 16
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def _key() -> str:
    h = hashlib.sha256()
    for part in (_SRC.read_bytes(), torch.__version__.encode(), sys.version.encode(), " ".join(_FLAGS).encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def build_dir() -> Path:
    root = Path(os.environ.get("RLKERNEL_BUILD_DIR") or Path.home() / ".cache" / "rlkernel")
    return root / f"strict_cpu_{_key()}"


def build(verbose: bool = False) -> Path:
    """Compile (if not cached) and load the library; returns its path. Raises on failure."""
    from torch.utils import cpp_extension

    # ninja comes with the project's dependencies into the interpreter's bin/, which is not on
    # PATH when the venv is not activated.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    name = f"rlkernel_strict_cpu_{_key()}"
    lib = d / f"{name}.so"
    if lib.exists() and not (d / "lock").exists():  # built, and no other process is building it now
        torch.ops.load_library(str(lib))
        return lib
    if not verbose:
        log.warning("rlkernel: compiling the fused CPU kernels (once per machine, about a minute) into %s", d)
    cpp_extension.load(name=name, sources=[str(_SRC)], build_directory=str(d), extra_cflags=_FLAGS,
                       is_python_module=False, verbose=verbose)
    return lib


def _load() -> bool:
    if _STATE["loaded"] is not None:
        return _STATE["loaded"]
    with _LOCK:
        if _STATE["loaded"] is not None:
            return _STATE["loaded"]
        if os.environ.get("RLKERNEL_FUSED", "1") == "0":
            _STATE.update(loaded=False, error="RLKERNEL_FUSED=0")
            return False
        try:
            _STATE["path"] = str(build())
            ok = _check_elementwise()
            _STATE.update(loaded=ok, error=None if ok else "self-check failed: fused exp/log differ from the composition")
        except Exception as e:  # a missing compiler or a failed build: the composition runs
            _STATE.update(loaded=False, error=f"{type(e).__name__}: {e}")
        if not _STATE["loaded"]:
            warnings.warn(f"rlkernel: fused CPU kernels off ({_STATE['error']}); the reference composition runs (same bits, slower)",
                          RuntimeWarning, stacklevel=3)
        return _STATE["loaded"]


def available() -> bool:
    """Whether the library is built, loaded and passed its self-check on this machine."""
    return _load()


def route(*tensors: torch.Tensor | None) -> str | None:
    """How a reference op on these tensors runs now: "kernel" (CPU tensors, no autograd graph
    wanted: the fused kernel alone), "autograd" (a CPU training forward: the fused kernel inside
    the op's autograd function), or None (the composition: turned off, not on the CPU, or the
    library is unavailable). None entries (an absent bias or residual) are skipped."""
    if _OFF.get():
        return None
    graph = False
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu":
            return None
        graph = graph or (t.requires_grad and torch.is_grad_enabled())
    if not _load():
        return None
    return "autograd" if graph else "kernel"


def active(*tensors: torch.Tensor | None) -> bool:
    """Whether a reference op on these tensors may run its fused kernel alone now (see route)."""
    return route(*tensors) == "kernel"


@contextlib.contextmanager
def disabled():
    """Run the enclosed reference ops as their torch composition (tests, negative controls)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def ops():
    return torch.ops.rlkernel


def status() -> dict:
    """What the fused path does in this process (for run provenance); loads the library first
    (building it if needed), so the record says what the run will use."""
    loaded = _load()
    return {"fused_cpu": bool(loaded), "library": _STATE["path"], "error": _STATE["error"],
            "attention_head_dims_checked": {str(k): v for k, v in sorted(_STATE["attention_checks"].items())},
            "plain_gemm_shapes_checked": {f"{k}x{n}": v for (k, n), v in sorted(_STATE["gemm_checks"].items())}}


def _check_elementwise() -> bool:
    from . import primitives

    g = torch.Generator().manual_seed(1234)
    x = torch.cat([torch.randn(4099, generator=g) * 30, torch.tensor([0.0, -0.0, 1e-30, -87.33, -87.34, 88.72, 88.73, 100.0, -100.0,
                                                                     float("inf"), float("-inf"), float("nan")])])
    y = torch.rand(4096, generator=g) * 1e4 + 1e-30
    with disabled():
        ref_e, ref_l = primitives.strict_exp(x), primitives.strict_log(y)
    return _same(torch.ops.rlkernel.exp(x), ref_e) and _same(torch.ops.rlkernel.log(y), ref_l)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def attention_ok(head_dim: int, kv_dtype: torch.dtype) -> bool:
    """Whether the fused attention may serve this head size: its q.k chain must be this machine's
    BLAS tile order, checked once per (head_dim, dtype) against the composition."""
    if not MIN_FUSED_HEAD_DIM <= head_dim <= MAX_FUSED_HEAD_DIM or _OFF.get() or not _load():
        return False
    key = (head_dim, str(kv_dtype).removeprefix("torch."))
    ok = _STATE["attention_checks"].get(key)
    if ok is None:
        from .ops import attention

        g = torch.Generator().manual_seed(head_dim)
        lens = [1, 37, 70]
        t, hkv = sum(lens), 2
        q = torch.randn(t, 2 * hkv, head_dim, generator=g).to(kv_dtype)
        k = torch.randn(t, hkv, head_dim, generator=g).to(kv_dtype)
        v = torch.randn(t, hkv, head_dim, generator=g).to(kv_dtype)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        scale = head_dim ** -0.5
        with disabled():
            ref = attention._varlen(attention._attend, q, k, v, cu, scale)
        got = torch.ops.rlkernel.attention_varlen(q, k, v, cu, scale).to(q.dtype)
        ok = bool(torch.equal(got, ref))
        _STATE["attention_checks"][key] = ok
        if not ok:
            warnings.warn(f"rlkernel: fused attention differs from the composition for head_dim {head_dim} on this machine; "
                          "the composition serves it (same bits, slower)", RuntimeWarning, stacklevel=3)
    return ok


def plain_gemm_ok(k: int, n: int) -> bool:
    """Whether one plain fp32 GEMM (or a batch of them, as the fused linear runs its K-segments)
    gives tile_matmul's bits for a [*, k] x [k, n] product on this machine (the BLAS's K order
    depends on K alone: measured, then checked here once per shape on random rows, a single
    padded row and a batched call included). Where it does not, the tile GEMMs run."""
    key = (int(k), int(n))
    ok = _STATE["gemm_checks"].get(key)
    if ok is None:
        from .primitives import TILE_ROWS, _tile_matmul

        g = torch.Generator().manual_seed(k * 7919 + n)
        x = torch.randn(3 * TILE_ROWS + 5, k, generator=g)
        w = torch.randn(k, n, generator=g)
        ref = _tile_matmul(x, w)
        pad = torch.nn.functional.pad(x[:1], (0, 0, 0, TILE_ROWS - 1))
        batched = torch.bmm(torch.stack([x, x.flip(0)]), torch.stack([w, w]).transpose(1, 2).contiguous().transpose(1, 2))
        ok = bool(torch.equal(torch.mm(x, w), ref) and torch.equal(torch.mm(pad, w)[:1], ref[:1])
                  and torch.equal(batched[0], ref) and torch.equal(batched[1].flip(0), ref))
        _STATE["gemm_checks"][key] = ok
        if not ok:
            log.warning("rlkernel: a plain GEMM [*, %d] x [%d, %d] differs from the tile GEMMs here; the tiles run", k, k, n)
    return ok


if __name__ == "__main__":  # `python -m rlkernel.fused`: build now (make install does), report
    import json

    logging.basicConfig(level=logging.INFO)
    ok = available()
    print(json.dumps(status(), indent=1))
    sys.exit(0 if ok else 1)
