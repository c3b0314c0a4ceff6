"""Compile-ahead for rlkernel's Triton kernels: record what a run compiled, compile it in parallel before the next run.

Why: a strict trainer's first step on a fresh machine spends ~2 minutes compiling Triton kernels one after another, as
each (kernel, specialization) is first launched (H200 sessions 22 and 24: 125-130 s; session 25: 63 kernels of a strict
forward + backward, 114 s of first launches).

- `Recorder` (Triton's official hooks, `knobs.runtime.jit_cache_hook` / `jit_post_compile_hook`, chained after any
  hooks already set): every time a process's JIT is about to compile or load a kernel of rlkernel's (`rlkernel.*`
  modules), it keeps Triton's own serialisation of that specialization (`specialization_data`: signature, constexprs,
  attributes, options, the JIT's cache key: what `JITFunction.preload` takes) and the compile's seconds. Nothing else
  changes: the hooks return the chained hooks' answers.
- `save(path)` merges the recorded entries into a JSON manifest (deduplicated by kernel and Triton's key; written
  atomically), tagged with the Triton version that made it.
- `compile_ahead(path)`: worker processes (`--worker i/n`) compile their shares (`plan`: longest recorded compile
  first, to the least-loaded worker) for the device's target into Triton's disk cache, without a GPU context; then the
  calling process preloads every entry (`JITFunction.preload` under Triton's `AsyncCompileMode`), which finds them on
  disk and fills the kernels' in-memory caches, so their first launches compile nothing. Threads alone do not scale
  (H200, session 25: 16 threads took 70 s for the 114 s above: Triton's frontend holds the GIL); processes do not
  share it. Which kernel runs, and so every bit, is still Triton's choice: a preloaded kernel is the one its own JIT
  compiles for that specialization (the same key; the session-25 check hashed the bits with and without). Entries that
  no longer fit (a kernel renamed or with another signature since, another Triton version, another GPU architecture:
  `for_arch`) are skipped and counted with their reason, never fatal: they compile at first launch as before. So are
  those the contracts no longer launch (`contract_stale`: an attention kernel specialised for another KV split).

- A seed (`make_seed` / `merge_seed`): the manifests of a recorded run, one per role ("trainer", "engine"), in one
  gzip'd JSON file that ships beside a recipe. `start(..., seed=, role=)` merges the role's entries into the run's
  manifest before compiling ahead, so a fresh run on a fresh machine starts warm (H100, session 36: the strict loop's
  first step 68 s cold, 7.7 s ahead). Entries the run's kernels no longer take are skipped as any stale entry is; a
  seed recorded under another Triton version is not merged (its reason is kept in the stats).

CLI: `python -m rlkernel.backends.triton.precompile MANIFEST [--workers N]` warms this machine's Triton cache from a
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
    """Keeps the specialization data of every rlkernel kernel this process's Triton JIT compiles or loads, and the
    seconds each compile took (Triton's pre- and post-compile hooks; a compile inline in the launching thread)."""

    def __init__(self, autosave: str | os.PathLike | None = None):
        """autosave: a manifest path merged after every new kernel's compile (a process with no natural end, such as a
        vLLM worker, keeps what it compiled even if it is killed)."""
        self.autosave = autosave
        self.entries: dict[tuple[str, str], str] = {}  # (kernel full name, Triton's key) -> specialization data
        self.seconds: dict[tuple[str, str], float] = {}  # the same -> compile (or disk-cache load) wall seconds
        self._lock = threading.Lock()
        self._started: dict[tuple[str, str], float] = {}
        self._prev = self._prev_post = None
        self._installed = False

    @staticmethod
    def _ident(key, fn, compile):  # noqa: A002
        data = (compile or {}).get("specialization_data")
        module = getattr(fn, "module", "") or ""
        if not data or not str(module).startswith(_PREFIX):
            return None, None
        return (json.loads(data)["name"], str(key)), data

    def hook(self, *, key=None, fn=None, compile=None, **kwargs):  # noqa: A002 -- Triton's keyword names
        """knobs.runtime.jit_cache_hook: called before Triton compiles (or loads from its disk cache) a kernel."""
        ident, data = self._ident(key, fn, compile)
        if ident is not None:
            with self._lock:
                self.entries.setdefault(ident, data)
                self._started[ident] = time.perf_counter()
        prev = self._prev
        return prev(key=key, fn=fn, compile=compile, **kwargs) if prev is not None else None

    def post_hook(self, *, key=None, fn=None, compile=None, is_manual_warmup=False, **kwargs):  # noqa: A002
        """knobs.runtime.jit_post_compile_hook: the compile's wall seconds (kept: the largest seen). A preload's
        (`is_manual_warmup`: compile_ahead's) is not timed: under the async mode it is the wait, not the compile."""
        ident, _ = self._ident(key, fn, compile)
        if ident is not None:
            with self._lock:
                t0 = self._started.pop(ident, None)
                if t0 is not None and not is_manual_warmup:
                    self.seconds[ident] = max(self.seconds.get(ident, 0.0), time.perf_counter() - t0)
            if self.autosave is not None and not is_manual_warmup:
                try:
                    self.save(self.autosave)
                except OSError:  # a read-only or full disk: the kernels still run; the next start compiles as before
                    pass
        prev = self._prev_post
        return prev(key=key, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup, **kwargs) \
            if prev is not None else None

    def install(self) -> "Recorder":
        from triton import knobs

        if not self._installed:
            self._prev, self._prev_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_cache_hook = self.hook
            knobs.runtime.jit_post_compile_hook = self.post_hook
            self._installed = True
        return self

    def uninstall(self) -> None:
        from triton import knobs

        if self._installed:
            if knobs.runtime.jit_cache_hook == self.hook:
                knobs.runtime.jit_cache_hook = self._prev
            if knobs.runtime.jit_post_compile_hook == self.post_hook:
                knobs.runtime.jit_post_compile_hook = self._prev_post
        self._installed = False

    def save(self, path: str | os.PathLike) -> int:
        """Merge the recorded entries into the manifest at `path`; the number of entries new to it."""
        with self._lock:
            recorded = {k: (d, self.seconds.get(k)) for k, d in self.entries.items()}
        return save_entries(path, recorded)


def load(path: str | os.PathLike) -> dict:
    """The manifest at `path` ({"format", "triton", "entries": [{"kernel", "key", "seconds", "data"}]}); empty if
    absent."""
    p = Path(path)
    if not p.exists():
        return {"format": FORMAT, "triton": _triton_version(), "entries": []}
    doc = json.loads(p.read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), list):
        raise ValueError(f"{p}: not an rlkernel kernel manifest of format {FORMAT}")
    return doc


def save_entries(path: str | os.PathLike, entries: dict) -> int:
    """Merge {(kernel, key): specialization data, or (data, compile seconds)} into the manifest at `path` (atomic
    replace); how many were new. A manifest written by another Triton version is replaced, not merged (its entries
    would not preload here). An entry's seconds are the largest seen (they order the compiles: longest first)."""
    p = Path(path)
    try:
        doc = load(p)
    except (ValueError, UnicodeDecodeError):  # a damaged file (a crash mid-write elsewhere): replaced by what we have
        doc = {}
    if doc.get("triton") != _triton_version():
        doc = {"format": FORMAT, "triton": _triton_version(), "entries": []}
    have = {(e["kernel"], e["key"]): e for e in doc["entries"]}
    new = changed = 0
    for (k, key), v in sorted(entries.items()):
        data, sec = v if isinstance(v, tuple) else (v, None)
        e = have.get((k, key))
        if e is None:
            e = have[(k, key)] = {"kernel": k, "key": key, "seconds": None, "data": data}
            doc["entries"].append(e)
            new += 1
        if sec is not None and (e.get("seconds") is None or sec > e["seconds"]):
            e["seconds"] = round(sec, 3)
            changed += 1
    if not (new or changed) and p.exists():
        return 0
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=0) + "\n")
    os.replace(tmp, p)
    return new


SEED_ROLES = ("trainer", "engine")


def make_seed(out: str | os.PathLike, manifests: dict, recorded: dict) -> dict:
    """Write a seed: {role: manifest} (SEED_ROLES; each as `load` reads one) and where they were recorded (device,
    code, recipe: kept verbatim) into `out` (gzip'd JSON, atomic replace). Returns {role: entry count}."""
    import gzip

    unknown = sorted(set(manifests) - set(SEED_ROLES))
    if unknown or not manifests:
        raise ValueError(f"a seed holds the roles {SEED_ROLES}, got {sorted(manifests)}")
    for role, m in manifests.items():
        if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("entries"), list):
            raise ValueError(f"seed role {role!r}: not an rlkernel kernel manifest of format {FORMAT}")
    doc = {"format": FORMAT, "kind": "rlkernel kernel manifest seed", "recorded": recorded, "roles": manifests}
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(json.dumps(doc, sort_keys=True).encode())  # no name, no time: the same manifests give the same bytes
    os.replace(tmp, p)
    return {role: len(m["entries"]) for role, m in manifests.items()}


def load_seed(path: str | os.PathLike) -> dict:
    """The seed at `path` (`make_seed`'s file): {"format", "kind", "recorded", "roles": {role: manifest}}."""
    import gzip

    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("roles"), dict):
        raise ValueError(f"{path}: not an rlkernel kernel manifest seed of format {FORMAT}")
    return doc


def merge_seed(path: str | os.PathLike, seed: str | os.PathLike, role: str) -> dict:
    """Merge the `role` manifest of the seed at `seed` into the manifest at `path` (the run's; created if absent).
    Returns {"seed", "role", "entries", "new", "skipped"}: `skipped` is None, or why nothing was merged (an unreadable
    seed, no such role, another Triton version). Never raises for the seed's sake: a seed only saves compile time."""
    if role not in SEED_ROLES:
        raise ValueError(f"role must be one of {SEED_ROLES}, got {role!r}")
    out = {"seed": str(seed), "role": role, "entries": 0, "new": 0, "skipped": None}
    try:
        m = load_seed(seed)["roles"].get(role)
    except (OSError, ValueError, EOFError) as ex:
        out["skipped"] = f"unreadable seed: {type(ex).__name__}: {str(ex)[:160]}"
        return out
    if not m or not m.get("entries"):
        out["skipped"] = f"the seed has no {role} entries"
        return out
    out["entries"] = len(m["entries"])
    if m.get("triton") != _triton_version():
        out["skipped"] = f"seed recorded under Triton {m.get('triton')}, this is {_triton_version()}"
        return out
    out["new"] = save_entries(path, {(e["kernel"], e["key"]): (e["data"], e.get("seconds")) for e in m["entries"]})
    return out


def plan(entries: list, workers: int) -> list[list[int]]:
    """Entry indices per worker: longest recorded compile first, each to the least-loaded worker (LPT; an entry with
    no recorded time counts as the median of the others). The same manifest gives every worker the same plan."""
    secs = [e.get("seconds") for e in entries]
    known = sorted(x for x in secs if x is not None)
    fill = known[len(known) // 2] if known else 1.0
    order = sorted(range(len(entries)), key=lambda i: (-(secs[i] if secs[i] is not None else fill), i))
    loads, shares = [0.0] * workers, [[] for _ in range(workers)]
    for i in order:
        w = min(range(workers), key=lambda j: (loads[j], j))
        shares[w].append(i)
        loads[w] += secs[i] if secs[i] is not None else fill
    return shares


def entry_arch(data: str) -> str | None:
    """The architecture an entry was compiled for: its options' "arch" as Triton's backend parsed them on the recording
    device ("sm90", "sm80", "gfx942"); None where the data names none."""
    try:
        arch = json.loads(data).get("options", {}).get("arch")
    except (ValueError, AttributeError):
        return None
    return arch if isinstance(arch, str) else None


def target_arch(target) -> str:
    """The "arch" Triton's backend parses for `target` (a GPUTarget): what entry_arch reads in entries made there."""
    from triton.compiler import make_backend

    return make_backend(target).parse_options({}).arch


def for_arch(entries: list, arch: str) -> tuple[list, dict]:
    """(the entries recorded for `arch`, {reason: n} for those recorded for another one). A manifest may hold several
    architectures (a run resumed on another GPU kind merges its own); an entry compiled for another architecture must
    never reach Triton's compiler here: its options carry that architecture, and lowering it for this target aborts
    the process inside LLVM (sm90 entries for sm_80 or sm_100: "LLVM ERROR: Cannot select: intrinsic
    %llvm.nvvm.wgmma..." / "...elect.sync"; seen on this CPU, session 30)."""
    mine, other = [], {}
    for e in entries:
        a = entry_arch(e.get("data", ""))
        if a is None or a == arch:
            mine.append(e)
        else:
            reason = f"recorded for {a}, this device is {arch}"
            other[reason] = other.get(reason, 0) + 1
    return mine, other


def constexprs(data: str) -> dict:
    """An entry's constexpr arguments by name (the kernel's top-level parameters only)."""
    obj = json.loads(data)
    names = list(obj.get("signature", {}))
    return {names[k[0]]: v.get("constexpr", v) if isinstance(v, dict) else v
            for k, v in zip(obj.get("constant_keys", []), obj.get("constant_vals", []))
            if isinstance(k, list) and len(k) == 1 and k[0] < len(names)}


def contract_stale(data: str) -> str | None:
    """Why an entry's specialization can no longer be launched under this checkout's contracts, or None. The one
    contract-derived constexpr: an attention kernel's SEG_CHUNKS x BLOCK_N is the contract's KV split (seg_keys), so an
    entry recorded under another split (attention v1's 512 keys; v2 since session 42: 2,048) is never launched again:
    it would compile ahead for nothing."""
    try:
        named = constexprs(data)
    except (ValueError, AttributeError, TypeError):
        return None
    if isinstance(named.get("SEG_CHUNKS"), int) and isinstance(named.get("BLOCK_N"), int):
        from .contracts import ATTENTION

        keys = named["SEG_CHUNKS"] * named["BLOCK_N"]
        if keys != ATTENTION.seg_keys:
            return f"a {keys}-key KV split, the attention contract's is {ATTENTION.seg_keys}"
    return None


def launchable(entries: list) -> tuple[list, dict]:
    """(the entries the contracts still launch, {reason: n} for the contract-stale ones)."""
    kept, stale = [], {}
    for e in entries:
        why = contract_stale(e.get("data", ""))
        if why is None:
            kept.append(e)
        else:
            stale[why] = stale.get(why, 0) + 1
    return kept, stale


def usable(entries: list, arch: str) -> tuple[list, dict]:
    """(the entries to compile for `arch`, {reason: n} for the others): `for_arch`'s, less the contract-stale ones."""
    mine, skipped = for_arch(entries, arch)
    kept, stale = launchable(mine)
    return kept, {**skipped, **stale}


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


def _source(fn, data: str, backend):
    """(ASTSource, options) for one entry, deserialised as Triton 3.6's `JITFunction.preload` does, so a worker's
    compile has the key (and lands in the disk-cache slot) that the preload in the training process looks up."""
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    obj = json.loads(data)
    if obj["name"] != fn._fn_name:
        raise RuntimeError(f"specialization data is for {obj['name']}, not {fn._fn_name}")
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()})
    if fn.is_gluon():  # a Gluon kernel (attention_gluon): its own source class, as JITFunction.preload takes for it
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource(fn, signature, constexprs, attrs), options
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_share(path: str | os.PathLike, target: str, worker: int, workers: int) -> dict:
    """A worker's share of the manifest (`plan`), compiled for `target` ("cuda:90:32") into Triton's disk cache without
    a GPU context: {"compiled", "skipped": {reason: n}, "seconds"}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile, make_backend

    t0 = time.perf_counter()
    be, arch, warp = target.split(":")
    tgt = GPUTarget(be, int(arch) if arch.isdigit() else arch, int(warp))
    backend = make_backend(tgt)
    entries, other = usable(load(path)["entries"], target_arch(tgt))
    out = {"worker": worker, "compiled": 0, "skipped": other if worker == 0 else {}}  # the others: counted once
    for i in plan(entries, workers)[worker]:
        e = entries[i]
        fn, why = _resolve(e["kernel"])
        try:
            if fn is None:
                raise LookupError(why)
            src, options = _source(fn, e["data"], backend)
            triton_compile(src, target=tgt, options=options.__dict__)
            out["compiled"] += 1
        except Exception as ex:  # noqa: BLE001 -- counted; the preload (or the first launch) compiles it instead
            r = f"{e['kernel']}: {type(ex).__name__}: {str(ex)[:160]}"
            out["skipped"][r] = out["skipped"].get(r, 0) + 1
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _run_workers(path, target: str, workers: int, timeout: float) -> list[dict]:
    """`workers` processes compiling their shares into this process's Triton cache dir; their reports."""
    import subprocess
    import sys

    from triton import knobs

    env = {**os.environ, "TRITON_CACHE_DIR": str(knobs.cache.dir)}
    procs = [subprocess.Popen([sys.executable, "-m", __name__, str(path), "--worker", f"{i}/{workers}", "--target",
                               target], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(workers)]
    reports = []
    deadline = time.monotonic() + timeout
    for i, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            rep = json.loads(so.strip().splitlines()[-1]) if p.returncode == 0 and so.strip() else \
                {"worker": i, "error": f"rc {p.returncode}: {se.strip()[-300:]}"}
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            rep = {"worker": i, "error": f"timed out after {timeout:.0f} s"}
        except ValueError as ex:
            rep = {"worker": i, "error": f"unreadable report: {ex}"}
        reports.append(rep)
    return reports


def compile_ahead(path: str | os.PathLike, threads: int | None = None, workers: int | None = None, progress=None,
                  timeout: float = 900.0, preload: bool = True) -> dict:
    """Compile every entry of the manifest at `path` for the current CUDA device, then preload them.

    workers > 1 (default: the CPU count, at most 16): that many processes first compile their shares (`plan`: longest
    recorded compile first) for this device's target into Triton's disk cache, with no GPU context of their own (a
    thread pool does not scale: Triton's frontend holds the GIL); then this process preloads every entry
    (`JITFunction.preload`, `threads` at a time under Triton's `AsyncCompileMode`), which finds them in the disk cache
    and puts them in the kernels' in-memory caches, so their first launches compile nothing. workers=1: the preload
    compiles them itself. preload=False: the workers only (one rank of a group fills the shared disk cache; every rank
    then preloads). Returns {"entries", "preloaded", "skipped": {reason: n}, "seconds", "workers", "worker_seconds",
    "preload_seconds", "threads"}; `progress(done, total)` after each preload."""
    t0 = time.perf_counter()
    stats = {"manifest": str(path), "entries": 0, "preloaded": 0, "skipped": {}, "threads": 0,
             "workers": 0, "worker_seconds": None, "preload_seconds": None, "seconds": 0.0}
    try:
        doc = load(path)
    except (ValueError, UnicodeDecodeError) as ex:  # never fatal: the kernels compile at first launch as before
        stats["skipped"][f"unreadable manifest: {str(ex)[:160]}"] = 1
        return stats
    entries = doc["entries"]
    stats["entries"] = len(entries)

    def skip(reason: str, n: int = 1):
        stats["skipped"][reason] = stats["skipped"].get(reason, 0) + n

    if not entries:
        return stats
    if doc.get("triton") != _triton_version():
        skip(f"manifest from Triton {doc.get('triton')}, this is {_triton_version()}", len(entries))
        return stats
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.driver import driver

    t = driver.active.get_current_target()
    entries, other = usable(entries, target_arch(t))  # the workers select the same entries for this target
    for reason, n in other.items():
        skip(reason, n)
    if not entries:
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        return stats
    cpus = os.cpu_count() or 1
    workers = min(workers if workers is not None else min(16, cpus), len(entries))
    if workers > 1:
        reports = _run_workers(path, f"{t.backend}:{t.arch}:{t.warp_size}", workers, timeout)
        stats["workers"] = workers
        stats["worker_seconds"] = round(time.perf_counter() - t0, 3)
        for r in reports:
            if "error" in r:
                skip(f"worker {r['worker']}: {r['error']}")
        stats["worker_reports"] = reports
    if not preload:
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        return stats
    t1 = time.perf_counter()
    threads = threads or min(32, cpus)
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
    stats["preload_seconds"] = round(time.perf_counter() - t1, 3)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    return stats


def _failure(ex: Exception) -> str:
    """An exception as a `skipped` reason."""
    return f"{type(ex).__name__}: {str(ex)[:200]}"


def _seeded(path, seed, role: str, log) -> dict | None:
    """merge_seed for start / start_group (None without a seed), logged; a failure to write is a reason, not a crash."""
    if not seed:
        return None
    try:
        got = merge_seed(path, seed, role)
    except Exception as ex:  # noqa: BLE001 -- an optimisation never stops a run
        got = {"seed": str(seed), "role": role, "entries": 0, "new": 0, "skipped": _failure(ex)}
    log(f"[rlkernel] kernel manifest seed {seed} ({role}): " + (f"not merged: {got['skipped']}" if got["skipped"] else
        f"{got['new']} of its {got['entries']} entries new to {path}"))
    return got


def start(path: str | os.PathLike, workers: int | None = None, ahead: bool = True, log=print, autosave: bool = True,
          seed: str | os.PathLike | None = None, role: str = "trainer"):
    """A process's compile-ahead in one call: merge the `role` entries of `seed` (a shipped seed: `merge_seed`) into
    `path`, install a Recorder (merging into `path` after every new compile when `autosave`), and, if `path` exists and
    `ahead`, compile_ahead from it first. Returns (recorder, compile_ahead's stats or None, without the workers' own
    reports: what provenance keeps; with the seed's merge under "seed"). Never raises for the manifest's sake (a
    damaged or stale one is reported in the stats)."""
    seeded = _seeded(path, seed, role, log)
    rec = Recorder(autosave=path if autosave else None).install()
    stats = None if seeded is None else {"entries": 0, "preloaded": 0, "seconds": 0.0, "skipped": {}}
    if ahead and Path(path).exists():
        log(f"[rlkernel] compiling Triton kernels ahead from {path} ...")
        try:
            stats = compile_ahead(path, workers=workers)
            stats.pop("worker_reports", None)
        except Exception as ex:  # noqa: BLE001 -- an optimisation never stops a run: first launches compile as before
            stats = {"entries": "?", "preloaded": 0, "seconds": 0.0, "skipped": {_failure(ex): 1}}
        log(f"[rlkernel] compile-ahead: {stats['preloaded']}/{stats['entries']} kernels in {stats['seconds']:.1f} s"
            + (f"; skipped: {stats['skipped']}" if stats["skipped"] else ""))
    if seeded is not None:
        stats["seed"] = seeded
    return rec, stats


def start_group(path: str | os.PathLike, rank: int, world: int, barrier, workers: int | None = None, log=print,
                seed: str | os.PathLike | None = None, role: str = "trainer"):
    """start() for one of `world` processes sharing a disk cache (a TP / CP trainer group, a TP engine's ranks): rank 0
    merges the seed, its worker processes compile the manifest once (compile_ahead with preload=False), every rank
    waits at `barrier()`, then every rank preloads from the disk cache (workers=1), so no other rank spawns compile
    processes of its own. Rank 0 alone records into the manifest and logs. world == 1: start(path, workers, seed=,
    role=). Every rank calls `barrier()` exactly once whatever happens on rank 0 (never fatal, like start)."""
    if world == 1:
        return start(path, workers=workers, log=log, seed=seed, role=role)
    filled = seeded = None
    if rank == 0:
        seeded = _seeded(path, seed, role, log)
    if rank == 0 and Path(path).exists():
        try:
            filled = compile_ahead(path, workers=workers, preload=False)
        except Exception as ex:  # noqa: BLE001 -- the other ranks wait at the barrier: never leave them there
            filled = {"seconds": 0.0, "workers": 0, "worker_seconds": None, "skipped": {_failure(ex): 1}}
    barrier()
    rec, stats = start(path, workers=1, log=log if rank == 0 else (lambda m: None), autosave=rank == 0)
    if stats is not None and filled is not None:  # rank 0's figures include its workers' compile
        stats["seconds"] = round(stats["seconds"] + filled["seconds"], 3)
        stats["workers"], stats["worker_seconds"] = filled["workers"], filled["worker_seconds"]
        for reason, n in filled["skipped"].items():
            stats["skipped"][reason] = stats["skipped"].get(reason, 0) + n
        log(f"[rlkernel] compile-ahead of rank 0's {filled['workers']} worker processes: {filled['seconds']:.1f} s")
    if stats is not None and seeded is not None:
        stats["seed"] = seeded
    return rec, stats


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Compile an rlkernel kernel manifest into this machine's Triton cache "
                                             "(on the GPU the kernels are for).")
    ap.add_argument("manifest")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None, help="compiling processes (default: CPUs, at most 16)")
    ap.add_argument("--worker", help="i/n: compile share i of n for --target, print its report (compile_ahead's "
                                     "worker processes; no GPU needed)")
    ap.add_argument("--target", help="backend:arch:warp_size, e.g. cuda:90:32 (with --worker)")
    args = ap.parse_args(argv)
    if not Path(args.manifest).exists():
        raise SystemExit(f"no manifest at {args.manifest}")
    if args.worker:
        if not args.target:
            raise SystemExit("--worker needs --target (e.g. cuda:90:32)")
        i, n = (int(x) for x in args.worker.split("/"))
        print(json.dumps(compile_share(args.manifest, args.target, i, n)))
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("compile-ahead preloads kernels for the current CUDA device; none here")
    stats = compile_ahead(args.manifest, args.threads, args.workers)
    print(json.dumps(stats, indent=1))
    return 0 if not stats["skipped"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
