"""Build and load the C++ kernels (csrc/), once per machine and ISA.

What this module decides: how the library is compiled, cached and loaded, and when it is
refused. The library is compiled on first use (about a minute on 2 cores; `make install`
does it ahead) into `$RLKERNEL_BUILD_DIR` or `~/.cache/rlkernel`, keyed by the sources,
torch, Python, the flags and (for `-march=native`) the CPU flags. `RLKERNEL_CPU_MARCH`
(default `native`) picks the instruction set it is compiled for; the bits do not depend on
it (tests/test_machine_independence.py builds x86-64-v2, haswell and native and compares).
A build holds an `flock` on a file beside the build directory: the kernel releases it when
the process dies, so a crashed build never leaves a lock that hangs the next process.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("rlkernel.backends.cpu")
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("elementwise.cpp", "norm.cpp", "rope.cpp", "attention.cpp", "linear.cpp", "gemm.cpp")
HEADERS = ("common.h", "gemm.h", "gemm_at.h")


def march() -> str:
    return os.environ.get("RLKERNEL_CPU_MARCH", "native")


def flags() -> list[str]:
    # -fopenmp: at::parallel_for is inlined into this library, and without OpenMP it runs serially
    return ["-O3", f"-march={march()}", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + (CSRC / name).read_bytes())
    for part in (torch.__version__, sys.version, " ".join(flags()), _cpu_flags() if march() == "native" else ""):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    root = Path(os.environ.get("RLKERNEL_BUILD_DIR") or Path.home() / ".cache" / "rlkernel")
    return root / f"strict_cpu_{key()}"


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
    name = f"rlkernel_strict_cpu_{key()}"
    lib = d / f"{name}.so"
    with open(str(d) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if not lib.exists():
            (d / "lock").unlink(missing_ok=True)  # torch's own baton, left by a build that died
            if not verbose:
                log.warning("rlkernel: compiling the CPU kernels for -march=%s (once per machine, about a minute) into %s", march(), d)
            cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES], build_directory=str(d),
                               extra_cflags=flags(), extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                               is_python_module=False, verbose=verbose)
    torch.ops.load_library(str(lib))
    return lib
