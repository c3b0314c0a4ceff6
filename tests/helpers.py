"""Shared helpers for the invariance tests: build batches around one fixed row."""
from __future__ import annotations

import contextlib
import re

import torch

BATCH_SIZES = (1, 2, 3, 7, 16, 64, 257)


def positions(m: int) -> tuple[int, ...]:
    return tuple(sorted({0, m // 2, m - 1}))


def row_failures(fn, row_inputs, make_inputs, sizes=BATCH_SIZES, seed=0):
    """Count (M, position) pairs where fn's output row differs from the row computed alone.

    row_inputs: tuple of tensors with a leading dim of 1 (the row under test).
    make_inputs(M, gen): tuple of tensors with leading dim M (other rows, random).
    """
    ref = fn(*row_inputs)[0]
    gen = torch.Generator().manual_seed(seed)
    bad = []
    for m in sizes:
        for pos in positions(m):
            args = [t.clone() for t in make_inputs(m, gen)]
            for a, r in zip(args, row_inputs):
                a[pos] = r[0]
            if not torch.equal(fn(*args)[pos], ref):
                bad.append((m, pos))
    return bad


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank, world, port, outdir, body, args):
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        torch.save(body(rank, *args), os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo_ranks(world: int, body, args: tuple, outdir: str, timeout: float = 240) -> list:
    """Spawn `world` gloo processes on a free local port; rank r returns body(r, *args)
    (a module-level function); returns the per-rank results, or fails with a rank's traceback."""
    import multiprocessing as mp
    import os

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, outdir, body, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
    for r, p in enumerate(procs):
        err = os.path.join(outdir, f"rank{r}.err")
        assert p.exitcode == 0, f"rank {r} exit {p.exitcode}\n" + (open(err).read() if os.path.exists(err) else "")
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=True) for r in range(world)]


def record_native(fact: str, differs: int) -> None:
    """A negative control's outcome on this CPU, recorded rather than asserted: the native op
    is another library's, and another CPU may happen to agree where this one did not. The strict
    side of the same test asserts; this line says whether the harness saw the native op differ."""
    import warnings

    line = f"native control: {fact}: {differs} differing" + ("" if differs else " (the native op happens not to differ on this CPU)")
    print(line)
    if not differs:
        warnings.warn(line, stacklevel=2)


def interpreter_env(**extra) -> dict:
    """The environment of a child under Triton's interpreter. The interpreter computes `tl.dot` with numpy's matmul,
    i.e. OpenBLAS, whose kernel (chosen by the CPU: Haswell's with FMA on an AVX2 machine, SkylakeX's on AVX-512) and
    thread count decide the float32 sums' rounding: a dot of one block shape against another's then agrees on one CPU
    and not on another (session 16: the fold and SwiGLU-epilogue checks passed on AVX-512 and failed on an AVX2 host).
    Pinned here to one OpenBLAS kernel without FMA that every x86-64 runs, on one thread, so the interpreter's bits are
    the same on every machine (the GPU's own bits are checked on the GPU)."""
    import os

    return dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_CORETYPE="Prescott", OPENBLAS_NUM_THREADS="1", **extra)


def run_interpreted(script: str, timeout: float = 600) -> str:
    """Run `script` in a fresh Python under TRITON_INTERPRET=1 (the interpreter must be chosen before triton is
    imported, hence a process of its own) from the repository root; its stdout, or a failure with its stderr's tail."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = interpreter_env(PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    if proc.returncode != 0 and NUMPY_VS_INTERPRETER in proc.stderr and "interpreter.py" in proc.stderr:
        import numpy
        import pytest

        pytest.skip(f"Triton's interpreter cannot run on NumPy {numpy.__version__} (>= 2.4 refuses its int() of a "
                    "1-element array; the CPU install pins numpy<2.4)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout.strip())
    return proc.stdout


NUMPY_VS_INTERPRETER = "only 0-dimensional arrays can be converted to Python scalars"


def last_json(stdout: str):
    """The last line of a child's stdout that is a JSON document.

    A child that runs Ray gets the raylet's and workers' log lines on its stdout, asynchronously: one can land after
    the child's own result line (CI saw "(raylet) A worker died ..." there), so "the last line" is not the result.
    One can also land between the document and its newline (CI under load saw `{...}\x1b[33m(raylet) A worker died`):
    the document at the start of a line is taken, whatever follows it there.
    """
    import json

    decoder = json.JSONDecoder()
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line[:1] in "{[":
            try:
                return decoder.raw_decode(line)[0]
            except ValueError:
                continue
    raise AssertionError(f"no JSON line in the child's stdout: {stdout[-2000:]!r}")


def wgmma_scale_d_not_always_on(ptx: str) -> list[str]:
    """The wgmma instructions of `ptx` whose scale-d operand (D = A.B + scale-d * D) is not a predicate fixed to true:
    a chain started with scale-d = 0 (Triton's accumulator-init rewrite, Gluon's `use_acc=False`) sums its first
    products without the zeroed accumulator, so a chain of all -0 products ends at -0 where the GEMM contract's
    chain "from +0.0" (and the CPU kernels) gives +0. Empty when every chain adds onto its zero-initialised
    accumulator. Asserts the PTX has wgmma at all."""
    lines = ptx.splitlines()
    always = {m.group(1) for m in re.finditer(r"mov\.pred\s+(%p\d+),\s*-1;", ptx)}
    written = {}
    for line in lines:  # a predicate written anywhere else (setp, another mov) is not fixed
        m = re.match(r"\s*(?:@!?%p\d+\s+)?(?:setp|mov\.pred|and\.pred|or\.pred|not\.pred)\S*\s+(%p\d+)", line)
        if m:
            written[m.group(1)] = written.get(m.group(1), 0) + 1
    mmas = [line.strip() for line in lines if "wgmma.mma_async" in line]
    assert mmas, "no wgmma in this PTX"
    bad = []
    for line in mmas:
        ops = [o.strip() for o in line.rstrip(";").split("}")[-1].split(",")]
        pred = ops[3]  # }, desc_a, desc_b, scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b
        if pred != "1" and not (pred in always and written.get(pred) == 1):
            bad.append(line)
    return bad


@contextlib.contextmanager
def cpu_fusion(ops: tuple, fn):
    """`fn` registered as the fusion of the chain `ops` for the implementations that run them on the CPU, for the block
    (the real fusions are the Triton backend's, CUDA only): for tests of the dispatcher's and the decoder's routing."""
    from rlkernel import dispatch

    key = (tuple(ops), tuple(dispatch.resolve(op, torch.device("cpu")).name for op in ops))
    dispatch.register_fusion(*key, fn)
    try:
        yield
    finally:
        dispatch._FUSIONS.pop(key)


# The preamble of a child process that launches a Gluon kernel with no GPU (tests of launch.py's fast path): Triton's
# driver is a stub for sm_90 (device 0, stream 0), `calls` records each launch a `Kernel` stand-in receives once it is
# put into Triton's kernel cache for the arguments (then `compute_cache_key(keys, spec, options)` finds it).
STUB_SM90_DRIVER = """import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import compute_cache_key

class Driver:  # Triton's driver without a GPU: sm_90's target, device 0, stream 0
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

driver.set_active(Driver())
calls = []


class Kernel:  # stands in for the CompiledKernel in Triton's cache; records each launch's arguments
    function, packed_metadata = "function", "metadata"

    def launch_metadata(self, grid, stream, *args):
        return "triton's own run"  # JITFunction.run passes this on; the fast path passes None

    def run(self, *args):
        calls.append(args)
"""


def sm90_toolchain_missing() -> str | None:
    """Why this Triton cannot compile for sm_90 here (its bundled ptxas missing or not runnable), or None."""
    import os

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90)
    except Exception as e:  # noqa: BLE001 -- any failure to find the tool is the reason
        return f"no ptxas for sm_90: {type(e).__name__}: {str(e)[:200]}"
    return None if os.access(ptxas.path, os.X_OK) else f"ptxas at {ptxas.path} is not executable"


def compile_sm90_or_skip(fn):
    """fn() (a compile for sm_90); a skip only where the toolchain is missing (`sm90_toolchain_missing`): a kernel that
    fails to compile where the toolchain is there (a ptxas error included) is a failure, not a skip."""
    import pytest

    why = sm90_toolchain_missing()
    if why is not None:
        pytest.skip(f"this Triton cannot compile for sm_90 here: {why}")
    return fn()


def ptxas_usage(ptx: str) -> str:
    """ptxas -v's registers / spills / warnings for a kernel's PTX (scripts/gpu_gluon_attn.ptxas_usage: Triton's
    bundled ptxas, no GPU needed)."""
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import gpu_gluon_attn as GA

    return GA.ptxas_usage(ptx)
