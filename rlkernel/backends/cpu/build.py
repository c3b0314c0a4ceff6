"""Build and load the C++ kernels (csrc/), once per machine and ISA.

What this module decides: how the library is compiled, cached and loaded, and when it is
refused. The library is compiled on first use (about a minute on 2 cores; `make install`
does it ahead) into `$RLKERNEL_BUILD_DIR` or `~/.cache/rlkernel`, keyed by the sources,
torch, Python, the flags and (for `-march=native`) the CPU flags. `RLKERNEL_CPU_MARCH`
(default `native`) picks the instruction set it is compiled for; the bits do not depend on
it (tests/test_machine_independence.py builds x86-64-v2, haswell and native and compares).
A build holds an `flock` on a file beside the build directory: the kernel releases it when
the process dies, so a crashed build never leaves a lock that hangs the next process.

The cache is verified before anything in it is loaded or run: the build directory must be
owned by this user and not writable by group or others (else it is refused: the composition
serves), and every file in it — the library, the objects ninja would relink, build.ninja —
must match the sha256 recorded in `manifest.json` when this process's build wrote them. A
file that does not match (or any file, when the manifest is missing or names another key)
is deleted and rebuilt before the library is loaded, with a warning naming it; so a
tampered or truncated `.so` is never loaded. Limit: the manifest sits beside the files it
covers, so this catches corruption and tampering by anyone who cannot write as this user —
who can rewrite the manifest too, as they could rewrite the installed package itself.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import stat
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


MANIFEST = "manifest.json"
_UNHASHED = (MANIFEST, "lock")  # the manifest itself; torch's build baton (removed before a build)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _hashes(d: Path) -> dict[str, str]:
    return {f.name: _sha256(f) for f in sorted(d.iterdir()) if f.is_file() and f.name not in _UNHASHED}


def check_owner(d: Path) -> None:
    """Refuse a cache another user could have written: owned by someone else, or group/world-writable."""
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = "is not owned by this user" if st.st_uid != os.getuid() else f"is writable by group or others (mode {stat.filemode(st.st_mode)})"
        raise PermissionError(f"rlkernel: the kernel cache {d} {why}; refusing to load code from it. "
                              f"Fix: remove it, or `chmod go-w {d}` if you trust its contents")


def untrusted_files(d: Path) -> list[str]:
    """Files of the build directory whose sha256 is not the one the manifest recorded (all of them without a valid manifest)."""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        recorded = manifest["files"] if manifest.get("key") == key() else {}
    except (OSError, ValueError, KeyError, AttributeError):
        recorded = {}
    return [name for name, digest in _hashes(d).items() if recorded.get(name) != digest]


def _write_manifest(d: Path) -> None:
    tmp = d / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"key": key(), "files": _hashes(d)}, indent=1))
    os.replace(tmp, d / MANIFEST)


def build(verbose: bool = False) -> Path:
    """Compile (if not cached) and load the library; returns its path. Raises on failure."""
    from torch.utils import cpp_extension

    # ninja comes with the project's dependencies into the interpreter's bin/, which is not on
    # PATH when the venv is not activated.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o755)
    name = f"rlkernel_strict_cpu_{key()}"
    lib = d / f"{name}.so"
    with open(str(d) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        check_owner(d)
        bad = untrusted_files(d)
        if bad:  # deleted with the library, so the build below recreates them (a relink when only the library was touched)
            log.warning("rlkernel: kernel cache %s: %s not as built (sha256 differs from %s, or no manifest); rebuilding", d,
                        ", ".join(bad), MANIFEST)
            for f in {*bad, lib.name}:
                (d / f).unlink(missing_ok=True)
        if not lib.exists():
            (d / "lock").unlink(missing_ok=True)  # torch's own baton, left by a build that died
            if not verbose:
                log.warning("rlkernel: compiling the CPU kernels for -march=%s (once per machine, about a minute) into %s", march(), d)
            cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES], build_directory=str(d),
                               extra_cflags=flags(), extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                               is_python_module=False, verbose=verbose)
            _write_manifest(d)
        torch.ops.load_library(str(lib))  # under the lock: no build can replace it between the check and the load
    return lib
