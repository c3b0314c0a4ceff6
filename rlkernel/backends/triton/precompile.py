"""Compile-ahead for rlkernel's Triton kernels: record what a run compiled, compile it in parallel before the next run.

Why: a strict trainer's first step on a fresh machine spends ~125 s compiling Triton kernels one after another, as each
(kernel, specialization) is first launched (H200 sessions 22 and 24). Triton compiles in parallel threads (its own
`AsyncCompileMode`; the GIL is released through the compiler: `scripts/bench_triton_compile.py`, 1.75x on two cores),
but only for kernels it knows about in advance.

- `Recorder` (Triton's official hook, `knobs.runtime.jit_cache_hook`, chained after any hook already set): every time a
  process's JIT is about to compile or load a kernel of rlkernel's (`rlkernel.*` modules), it keeps Triton's own
  serialisation of that specialization (`specialization_data`: signature, constexprs, attributes, options, the JIT's
  cache key) — what `JITFunction.preload` takes. Nothing else changes: the hook returns the chained hook's answer.
- `save(path)` merges the recorded entries into a JSON manifest (deduplicated by kernel and Triton's key; written
  atomically), tagged with the Triton version that made it.
- `compile_ahead(path, threads)` preloads every entry through `JITFunction.preload` under Triton's `AsyncCompileMode`
  on a thread pool: each specialization lands in Triton's disk cache and in the kernel's in-memory cache, so its first
  launch compiles nothing. Which kernel runs, and so every bit, is still Triton's choice for that launch: a preloaded
  kernel is the one its own JIT would compile for the same specialization (the key is Triton's). Entries that no longer
  fit (a kernel renamed or with another signature since the manifest was written, another Triton version) are skipped
  and counted with their reason, never fatal: they compile at first launch as before.

CLI: `python -m rlkernel.backends.triton.precompile MANIFEST [--threads N]` warms this machine's Triton cache from a
manifest (on a GPU); vime's trainer does it at start from `trainer.kernel_manifest` (default: the run directory's
`triton_kernels.json`) and records into the same file.
"""
from __future__ import annotations

import importlib
import json
import os
import threading
import time
from pathlib import Path

FORMAT = 1
_PREFIX = "rlkernel."


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


class Recorder:
    """Keeps the specialization data of every rlkernel kernel this process's Triton JIT compiles or loads."""

    def __init__(self):
        self.entries: dict[tuple[str, str], str] = {}  # (kernel full name, Triton's key) -> specialization data
        self._lock = threading.Lock()
        self._prev = None
        self._installed = False

    def hook(self, *, key=None, fn=None, compile=None, **kwargs):  # noqa: A002 -- Triton's keyword names
        """knobs.runtime.jit_cache_hook: called before Triton compiles (or loads from its disk cache) a kernel."""
        data = (compile or {}).get("specialization_data")
        module = getattr(fn, "module", "") or ""
        if data and module.startswith(_PREFIX):
            name = json.loads(data)["name"]
            with self._lock:
                self.entries.setdefault((name, str(key)), data)
        prev = self._prev
        return prev(key=key, fn=fn, compile=compile, **kwargs) if prev is not None else None

    def install(self) -> "Recorder":
        from triton import knobs

        if not self._installed:
            self._prev = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self.hook
            self._installed = True
        return self

    def uninstall(self) -> None:
        from triton import knobs

        if self._installed and knobs.runtime.jit_cache_hook is self.hook:
            knobs.runtime.jit_cache_hook = self._prev
        self._installed = False

    def save(self, path: str | os.PathLike) -> int:
        """Merge the recorded entries into the manifest at `path`; the number of entries new to it."""
        with self._lock:
            recorded = dict(self.entries)
        return save_entries(path, recorded)


def load(path: str | os.PathLike) -> dict:
    """The manifest at `path` ({"format", "triton", "entries": [{"kernel", "key", "data"}]}); empty if absent."""
    p = Path(path)
    if not p.exists():
        return {"format": FORMAT, "triton": _triton_version(), "entries": []}
    doc = json.loads(p.read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), list):
        raise ValueError(f"{p}: not an rlkernel kernel manifest of format {FORMAT}")
    return doc


def save_entries(path: str | os.PathLike, entries: dict[tuple[str, str], str]) -> int:
    """Merge {(kernel, key): specialization data} into the manifest at `path` (atomic replace); how many were new.
    A manifest written by another Triton version is replaced, not merged (its entries would not preload here)."""
    p = Path(path)
    doc = load(p) if p.exists() else {"format": FORMAT, "triton": _triton_version(), "entries": []}
    if doc.get("triton") != _triton_version():
        doc = {"format": FORMAT, "triton": _triton_version(), "entries": []}
    have = {(e["kernel"], e["key"]) for e in doc["entries"]}
    new = [{"kernel": k, "key": key, "data": d} for (k, key), d in sorted(entries.items()) if (k, key) not in have]
    if not new and p.exists():
        return 0
    doc["entries"].extend(new)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=0) + "\n")
    os.replace(tmp, p)
    return len(new)


def _resolve(full_name: str):
    """The JITFunction named `module.qualname` (the name Triton serialises), or a reason it is not one."""
    parts = full_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except AttributeError:
            return None, f"{full_name}: no such kernel in this checkout"
        return (obj, None) if hasattr(obj, "preload") else (None, f"{full_name}: not a Triton JIT function")
    return None, f"{full_name}: module not importable"


def compile_ahead(path: str | os.PathLike, threads: int | None = None, progress=None) -> dict:
    """Preload every entry of the manifest at `path` into Triton's caches, `threads` compiles at a time (default:
    the CPU count, at most 32). Needs the GPU the kernels are for (the current CUDA device). Returns
    {"entries", "preloaded", "skipped": {reason: count}, "seconds", "threads"}; `progress(done, total)` after each."""
    t0 = time.perf_counter()
    doc = load(path)
    entries = doc["entries"]
    stats = {"manifest": str(path), "entries": len(entries), "preloaded": 0, "skipped": {}, "threads": 0,
             "seconds": 0.0}

    def skip(reason: str, n: int = 1):
        stats["skipped"][reason] = stats["skipped"].get(reason, 0) + n

    if not entries:
        return stats
    if doc.get("triton") != _triton_version():
        skip(f"manifest from Triton {doc.get('triton')}, this is {_triton_version()}", len(entries))
        return stats
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from triton.runtime._async_compile import AsyncCompileMode

    threads = threads or min(32, os.cpu_count() or 1)
    stats["threads"] = threads
    pending = {}
    with ThreadPoolExecutor(max_workers=threads) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for e in entries:
            fn, why = _resolve(e["kernel"])
            if fn is None:
                skip(why)
                continue
            try:
                k = fn.preload(e["data"])
            except Exception as ex:  # noqa: BLE001 -- a stale entry (signature changed) compiles at first launch instead
                skip(f"{e['kernel']}: {type(ex).__name__}: {str(ex)[:160]}")
                continue
            fut = getattr(k, "future", None)  # a FutureKernel under the async mode; a kernel if Triton compiled inline
            if fut is None:
                stats["preloaded"] += 1
            else:
                pending[fut] = e["kernel"]
        for i, fut in enumerate(as_completed(pending)):
            try:
                fut.result()
                stats["preloaded"] += 1
            except Exception as ex:  # noqa: BLE001
                skip(f"{pending[fut]}: {type(ex).__name__}: {str(ex)[:160]}")
            if progress is not None:
                progress(i + 1, len(pending))
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    return stats


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Compile an rlkernel kernel manifest into this machine's Triton cache "
                                             "(on the GPU the kernels are for).")
    ap.add_argument("manifest")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if not Path(args.manifest).exists():
        raise SystemExit(f"no manifest at {args.manifest}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("compile-ahead preloads kernels for the current CUDA device; none here")
    stats = compile_ahead(args.manifest, args.threads)
    print(json.dumps(stats, indent=1))
    return 0 if not stats["skipped"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
