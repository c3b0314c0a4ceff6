"""Compile-ahead (`rlkernel/backends/triton/precompile.py`) on a machine without a GPU: the recorder behind Triton's
jit hooks, the manifest file, the longest-first plan, and the worker processes that compile recorded specializations
for sm_90 into Triton's disk cache. What needs the GPU (the preload into the JIT's caches; a first launch then compiling
nothing; the bits of preloaded kernels) is `scripts/gpu_precompile_check.py` (`gpu_session.py precompile_check`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from rlkernel.backends.triton import precompile as P  # noqa: E402
from helpers import sm90_toolchain_missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _Info:  # what Triton passes as `fn` to its jit hooks (JitFunctionInfo: module name, kernel name, function)
    def __init__(self, module):
        self.module = module


def _data(name: str, **extra) -> str:
    return json.dumps({"name": name, **extra})


def test_recorder_keeps_rlkernel_kernels_times_their_compiles_and_chains_the_hooks_already_set():
    from triton import knobs

    seen = []

    def prev_pre(**kw):
        seen.append(("pre", kw["key"]))
        return None

    def prev_post(**kw):
        seen.append(("post", kw["key"]))
        return "post-result"

    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = prev_pre, prev_post
    try:
        rec = P.Recorder().install()
        assert knobs.runtime.jit_cache_hook == rec.hook and knobs.runtime.jit_post_compile_hook == rec.post_hook
        ours = dict(fn=_Info("rlkernel.backends.triton.gemm"),
                    compile={"specialization_data": _data("rlkernel.backends.triton.gemm._gemm_kernel")})
        theirs = dict(fn=_Info("someone.else"), compile={"specialization_data": _data("someone.else.k")})
        assert knobs.runtime.jit_cache_hook(key="k1", repr="r", **ours) is None
        assert knobs.runtime.jit_post_compile_hook(key="k1", repr="r", **ours) == "post-result"
        knobs.runtime.jit_cache_hook(key="k2", repr="r", **theirs)
        knobs.runtime.jit_post_compile_hook(key="k2", repr="r", **theirs)
        assert list(rec.entries) == [("rlkernel.backends.triton.gemm._gemm_kernel", "k1")]
        assert rec.seconds[("rlkernel.backends.triton.gemm._gemm_kernel", "k1")] >= 0.0
        assert seen == [("pre", "k1"), ("post", "k1"), ("pre", "k2"), ("post", "k2")]  # every call reached the chain
        rec.uninstall()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (prev_pre, prev_post)
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old


def test_start_records_and_autosaves_each_new_compile_and_a_preload_is_not_timed(tmp_path):
    """precompile.start on a path with no manifest yet: nothing to compile ahead; the recorder merges each new
    compile into the file as it finishes (a vLLM worker has no natural end to save at); a preload's post hook
    (is_manual_warmup: compile_ahead's) neither saves nor counts its wait as a compile time."""
    from triton import knobs

    path = tmp_path / "run" / "triton_kernels.json"
    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        rec, stats = P.start(path, log=lambda m: None)
        assert stats is None and not path.exists()
        kw = dict(fn=_Info("rlkernel.backends.triton.norm"),
                  compile={"specialization_data": _data("rlkernel.backends.triton.norm._rmsnorm_kernel")})
        knobs.runtime.jit_cache_hook(key="k1", repr="r", **kw)
        knobs.runtime.jit_post_compile_hook(key="k1", repr="r", is_manual_warmup=False, **kw)
        doc = P.load(path)
        assert [(e["kernel"], e["key"]) for e in doc["entries"]] == [("rlkernel.backends.triton.norm._rmsnorm_kernel", "k1")]
        assert doc["entries"][0]["seconds"] is not None
        knobs.runtime.jit_cache_hook(key="k2", repr="r", **kw)
        knobs.runtime.jit_post_compile_hook(key="k2", repr="r", is_manual_warmup=True, **kw)
        assert len(P.load(path)["entries"]) == 1 and ("rlkernel.backends.triton.norm._rmsnorm_kernel", "k2") not in rec.seconds
        assert rec.save(path) == 1 and P.load(path)["entries"][1]["seconds"] is None  # recorded, untimed
        rec.uninstall()
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old


def test_a_hook_that_asks_triton_to_skip_a_compile_still_decides():
    """Triton skips a compile when its jit_cache_hook returns true: the recorder passes the chained hook's answer on."""
    from triton import knobs

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: True
    try:
        rec = P.Recorder().install()
        assert rec.hook(key="k", fn=_Info("rlkernel.x"), compile={"specialization_data": _data("rlkernel.x.k")}) is True
        rec.uninstall()
    finally:
        knobs.runtime.jit_cache_hook = old


def test_manifest_merges_dedupes_keeps_the_longest_time_and_is_replaced_under_another_triton(tmp_path):
    path = tmp_path / "m.json"
    assert P.load(path)["entries"] == []
    assert P.save_entries(path, {("rlkernel.a.k", "1"): ("d1", 2.0), ("rlkernel.a.k", "2"): "d2"}) == 2
    assert P.save_entries(path, {("rlkernel.a.k", "1"): ("d1", 5.0), ("rlkernel.b.k", "1"): ("d3", 1.0)}) == 1
    assert P.save_entries(path, {("rlkernel.a.k", "1"): ("d1", 3.0)}) == 0
    doc = json.loads(path.read_text())
    assert doc["triton"] == triton.__version__ and doc["format"] == P.FORMAT
    got = {(e["kernel"], e["key"]): (e["data"], e["seconds"]) for e in doc["entries"]}
    assert got == {("rlkernel.a.k", "1"): ("d1", 5.0), ("rlkernel.a.k", "2"): ("d2", None),
                   ("rlkernel.b.k", "1"): ("d3", 1.0)}
    doc["triton"] = "0.0.1"
    path.write_text(json.dumps(doc))
    assert P.save_entries(path, {("rlkernel.c.k", "1"): "d4"}) == 1
    assert [e["kernel"] for e in json.loads(path.read_text())["entries"]] == ["rlkernel.c.k"]
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an rlkernel kernel manifest"):
        P.load(path)
    st = P.compile_ahead(path)  # a damaged manifest is reported, never fatal; the next save replaces it
    assert st["preloaded"] == 0 and list(st["skipped"]) == [f"unreadable manifest: {path}: not an rlkernel kernel "
                                                            f"manifest of format {P.FORMAT}"]
    assert P.save_entries(path, {("rlkernel.d.k", "1"): "d5"}) == 1
    assert [e["kernel"] for e in P.load(path)["entries"]] == ["rlkernel.d.k"]


def test_plan_gives_the_longest_compiles_first_each_to_the_least_loaded_worker():
    entries = [{"seconds": s} for s in (5.0, 1.0, None, 4.0, 3.0, 9.0)]
    shares = P.plan(entries, 3)
    assert sorted(i for s in shares for i in s) == list(range(6))
    assert shares[0][0] == 5 and shares[1][0] == 0  # 9 s, then 5 s, each on its own worker
    loads = [sum(entries[i]["seconds"] or 4.0 for i in s) for s in shares]  # the unknown one counts as the median (4)
    assert max(loads) - min(loads) <= 5.0
    assert P.plan(entries, 1) == [[5, 0, 2, 3, 4, 1]]


def test_compile_ahead_without_a_usable_manifest_reports_and_never_fails(tmp_path):
    assert P.compile_ahead(tmp_path / "absent.json")["entries"] == 0
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": P.FORMAT, "triton": "0.0.1", "entries": [{"kernel": "rlkernel.a.k",
                                                                                      "key": "1", "data": "{}"}]}))
    st = P.compile_ahead(path)
    assert st["preloaded"] == 0 and st["skipped"] == {f"manifest from Triton 0.0.1, this is {triton.__version__}": 1}


def _entries_for_sm90() -> dict:
    """Specialization data as Triton's jit hook records it (`serialize_specialization_data`), for two real kernels:
    the packed-prefill attention (descriptors) and a GEMM tile; options as the sm_90 backend parses them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    from rlkernel.backends.triton import attention as A

    backend = make_backend(GPUTarget("cuda", 90, 32))
    out = {}
    args = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "bt_ptr", "qs_ptr", "ql_ptr", "kl_ptr", "ks_ptr", "po_ptr", "pml_ptr",
            "lse_ptr", "sqt", "sqh", "sot", "soh", "skb", "skt", "skh", "sbt", "qk_scale", "n_tiles", "nseg", "kv_rows")
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "bt_ptr": "*i32", "qs_ptr": "*i32",
             "ql_ptr": "*i32", "kl_ptr": "*i32", "ks_ptr": "*i32", "po_ptr": "*fp32", "pml_ptr": "*fp32",
             "lse_ptr": "*fp32", "qk_scale": "fp32"}
    seg_chunks = A.C.ATTENTION.seg_keys // 64  # the contract's KV split (an entry with another is contract-stale)
    const = dict(G=4, BLOCK_M=64, BLOCK_N=64, D=128, SEG_CHUNKS=seg_chunks, PAGED=False, SPLIT=False, PAGE=16,
                 IEEE=False, STORE_LSE=True, NESTED=False, TMA=True)
    names = [p.name for p in A._attn_fwd.params]
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    cx = {(names.index(n),): v for n, v in const.items()}
    opts = backend.parse_options({"num_warps": 4, "num_stages": 3, "enable_fp_fusion": False})
    out[("rlkernel.backends.triton.attention._attn_fwd", "a")] = serialize_specialization_data(
        A._attn_fwd._fn_name, sig, cx, {}, opts, "a")
    out[("rlkernel.backends.triton.gemm._gemm_kernel", "g")] = _gemm_entry(90, "g", 4, BLOCK_N=128, BLOCK_K=128,
                                                                           NUM_PROGS=132, TMA=True)
    from rlkernel.backends.triton import attention_gluon as AG
    if AG._IMPORT_ERROR is None:  # the Gluon prefill (its own source class; descriptors carry their shared layout)
        from triton.experimental.gluon import language as gl
        lay = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
        gl_const = dict(G=4, BLOCK_M=64, BLOCK_N=64, D=128, SEG_CHUNKS=seg_chunks, STAGES=AG.STAGES, STORE_LSE=True,
                        NFULL=1, DIAG=0, SKIP=0, QREG=AG.QREG, QK_FIRST=AG.QK_FIRST, num_warps=4)
        gl_types = {"q_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32", "qs_ptr": "*i32", "ql_ptr": "*i32",
                    "kl_ptr": "*i32", "ks_ptr": "*i32", "qk_scale": "fp32",
                    "k_desc": f"tensordesc<bf16[64, 128],{lay!r}>", "v_desc": f"tensordesc<bf16[64, 128],{lay!r}>"}
        gl_names = [p.name for p in AG._prefill_kernel.params]
        gl_sig = {n: "constexpr" if n in gl_const else gl_types.get(n, "i32") for n in gl_names}
        gl_cx = {(gl_names.index(n),): v for n, v in gl_const.items()}
        out[("rlkernel.backends.triton.attention_gluon._prefill_kernel", "p")] = serialize_specialization_data(
            AG._prefill_kernel._fn_name, gl_sig, gl_cx, {}, backend.parse_options({"num_warps": 4,
                                                                                  "enable_fp_fusion": False}), "p")
    out[("rlkernel.backends.triton.attention._gone", "x")] = json.dumps({"name": "rlkernel.backends.triton.attention._gone"})
    return out


def _cache_files(d: Path) -> set:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def test_worker_processes_compile_recorded_specializations_for_sm90_into_the_cache(tmp_path):
    """Two workers (the CLI compile_ahead spawns) split the manifest, compile each entry for sm_90 into the Triton
    cache dir they are given, and report a stale entry (a kernel renamed since) instead of failing. A second pass finds
    everything in the cache: the directory does not change."""
    path = tmp_path / "m.json"
    entries = _entries_for_sm90()
    n = len(entries) - 1  # the kernels that exist (the Gluon prefill's among them where Gluon imports)
    P.save_entries(path, {k: (d, s) for (k, d), s in zip(entries.items(), (2.0, 1.0, 0.7, 0.5))})
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)

    def run_workers():
        reps = []
        for i in range(2):
            p = subprocess.run([sys.executable, "-m", "rlkernel.backends.triton.precompile", str(path), "--worker",
                                f"{i}/2", "--target", "cuda:90:32"], env=env, capture_output=True, text=True,
                               timeout=600, cwd=ROOT)
            assert p.returncode == 0, p.stderr[-2000:]
            reps.append(json.loads(p.stdout.strip().splitlines()[-1]))
        return reps

    if sm90_toolchain_missing():
        pytest.skip(f"this Triton cannot compile for sm_90 here: {sm90_toolchain_missing()}")
    reps = run_workers()
    assert sum(r["compiled"] for r in reps) == n, reps
    skipped = {k: v for r in reps for k, v in r["skipped"].items()}
    assert list(skipped) == ["rlkernel.backends.triton.attention._gone: LookupError: "
                             "rlkernel.backends.triton.attention._gone: no such kernel in this checkout"], skipped
    files = _cache_files(cache)
    assert any(f.endswith(".cubin") for f in files), sorted(files)[:10]
    assert sum(f.endswith(".cubin") for f in files) == n
    reps2 = run_workers()
    assert sum(r["compiled"] for r in reps2) == n and _cache_files(cache) == files


def _gemm_entry(arch: int, key: str | None = None, num_stages: int = 3, **tile) -> str:
    """A GEMM tile's specialization data as Triton records it on an sm_{arch} device (its options carry the arch);
    `tile` overrides the constexprs of a 64 x 64 x 64 pointer-load tile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    from rlkernel.backends.triton import gemm

    names = [p.name for p in gemm._gemm_kernel.params]
    const = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, NUM_PROGS=108, TMA=False, B_NK=True, IEEE=False,
                 SEGS=1, SPLIT=False, K_FIXED=0, STREAM=False, FIXUP=False, BLOCK_N2=0, SCRATCH=False, SLOTS=0,
                 SLICED=False, ws_ptr=None, cnt_ptr=None) | tile
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    cx = {(names.index(n),): v for n, v in const.items()}
    opts = make_backend(GPUTarget("cuda", arch, 32)).parse_options({"num_warps": 4, "num_stages": num_stages})
    return serialize_specialization_data(gemm._gemm_kernel._fn_name, sig, cx, {}, opts, key or f"g{arch}")


def test_entries_of_another_gpu_architecture_are_skipped_never_compiled(tmp_path):
    """A manifest holding sm_90 and sm_80 entries (a run resumed on another GPU kind merges its own): the workers for
    each target compile that target's entries and skip the others, counted with the reason, and nothing aborts. The
    control: an sm_90 entry compiled for sm_80 aborts the process inside LLVM (what `for_arch` keeps from the trainer's
    preload, a crash with no Python traceback)."""
    if sm90_toolchain_missing():
        pytest.skip(f"this Triton cannot compile for sm_80 / sm_90 here: {sm90_toolchain_missing()}")
    path = tmp_path / "m.json"
    e90, e80 = _gemm_entry(90), _gemm_entry(80)
    assert P.entry_arch(e90) == "sm90" and P.entry_arch(e80) == "sm80" and P.entry_arch("{}") is None
    G = "rlkernel.backends.triton.gemm._gemm_kernel"
    P.save_entries(path, {(G, "g90"): (e90, 1.0), (G, "g80"): (e80, 0.5)})
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    for target, other in (("cuda:90:32", "recorded for sm80, this device is sm90"),
                          ("cuda:80:32", "recorded for sm90, this device is sm80")):
        p = subprocess.run([sys.executable, "-m", "rlkernel.backends.triton.precompile", str(path), "--worker", "0/1",
                            "--target", target], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-2000:]
        rep = json.loads(p.stdout.strip().splitlines()[-1])
        assert rep["compiled"] == 1 and rep["skipped"] == {other: 1}, (target, rep)
    entries = P.load(path)["entries"]
    assert [P.entry_arch(e["data"]) for e in P.for_arch(entries, "sm90")[0]] == ["sm90"]
    control = f"""
from triton.backends.compiler import GPUTarget
from triton.compiler import compile, make_backend
from rlkernel.backends.triton import gemm, precompile as P
backend = make_backend(GPUTarget("cuda", 80, 32))
src, options = P._source(gemm._gemm_kernel, {e90!r}, backend)
compile(src, target=GPUTarget("cuda", 80, 32), options=options.__dict__)
print("compiled")
"""
    c = subprocess.run([sys.executable, "-c", control], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert c.returncode != 0 and "LLVM ERROR" in c.stderr, (c.returncode, c.stdout[-500:], c.stderr[-1000:])


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_has_cuda(), reason="the case is a machine without a GPU driver")
def test_start_never_raises_when_compile_ahead_cannot_run(tmp_path):
    """An optimisation never stops a run: here (no GPU driver) compile_ahead cannot ask the device for its target
    (two entries, two workers); start reports the error in the stats and leaves the recorder installed."""
    from triton import knobs

    path = tmp_path / "m.json"
    P.save_entries(path, {("rlkernel.backends.triton.norm._rmsnorm_kernel", "k"): "{}",
                          ("rlkernel.backends.triton.norm._rmsnorm_kernel", "k2"): "{}"})
    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        logged = []
        rec, st = P.start(path, workers=2, log=logged.append)
        assert st["preloaded"] == 0 and list(st["skipped"].values()) == [1] and "driver" in next(iter(st["skipped"])), st
        assert knobs.runtime.jit_cache_hook == rec.hook and len(logged) == 2
        rec.uninstall()
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old


def _manifest(triton_version, *names) -> dict:
    return {"format": P.FORMAT, "triton": triton_version,
            "entries": [{"kernel": f"rlkernel.backends.triton.norm.{n}", "key": f"k_{n}", "seconds": 0.5,
                         "data": _data(n)} for n in names]}


def test_a_seed_is_reproducible_merges_its_role_once_and_is_refused_from_another_triton(tmp_path):
    """make_seed writes the same bytes for the same manifests; merge_seed adds a role's entries to a run's manifest
    (created if absent, entries already there kept), a second merge adds none; a seed recorded under another Triton,
    an unreadable file, a role it lacks: nothing merged and the reason said (a seed only saves compile time)."""
    tv = triton.__version__
    seed = tmp_path / "s.json.gz"
    counts = P.make_seed(seed, {"trainer": _manifest(tv, "t1", "t2"), "engine": _manifest(tv, "e1")}, {"device": "x"})
    assert counts == {"trainer": 2, "engine": 1}
    first = seed.read_bytes()
    P.make_seed(seed, {"trainer": _manifest(tv, "t1", "t2"), "engine": _manifest(tv, "e1")}, {"device": "x"})
    assert seed.read_bytes() == first and first[:2] == b"\x1f\x8b"  # gzip, no name or time in its header
    assert P.load_seed(seed)["recorded"] == {"device": "x"}
    run = tmp_path / "run" / "triton_kernels.json"
    got = P.merge_seed(run, seed, "trainer")
    assert (got["entries"], got["new"], got["skipped"]) == (2, 2, None)
    assert [e["kernel"].rsplit(".", 1)[1] for e in P.load(run)["entries"]] == ["t1", "t2"]
    assert P.merge_seed(run, seed, "trainer")["new"] == 0
    eng = tmp_path / "run" / "triton_kernels_vllm-0.json"
    P.save_entries(eng, {("rlkernel.backends.triton.norm.mine", "k_mine"): _data("mine")})  # recorded by this run
    assert P.merge_seed(eng, seed, "engine")["new"] == 1
    assert sorted(e["key"] for e in P.load(eng)["entries"]) == ["k_e1", "k_mine"]
    old = tmp_path / "old.json.gz"
    P.make_seed(old, {"trainer": _manifest("0.0.1", "t1")}, {})
    other = tmp_path / "run2" / "triton_kernels.json"
    got = P.merge_seed(other, old, "trainer")
    assert got["new"] == 0 and "Triton 0.0.1" in got["skipped"] and not other.exists()
    assert "no engine entries" in P.merge_seed(other, old, "engine")["skipped"]
    junk = tmp_path / "junk.json.gz"
    junk.write_text("not gzip")
    assert P.merge_seed(other, junk, "trainer")["skipped"].startswith("unreadable seed") and not other.exists()
    with pytest.raises(ValueError, match="role"):
        P.merge_seed(other, seed, "critic")
    with pytest.raises(ValueError, match="roles"):
        P.make_seed(tmp_path / "x.json.gz", {"critic": _manifest(tv, "t1")}, {})


def test_start_merges_the_seed_first_and_reports_it_in_the_stats(tmp_path):
    """start(seed=, role=) on a run with no manifest yet: the seed's entries for that role are in the run's manifest
    before compile-ahead (which cannot run here: no GPU driver, reported, never raised), and the stats say what the
    seed gave. Without a seed nothing is written and there are no stats."""
    from triton import knobs

    seed = tmp_path / "s.json.gz"
    P.make_seed(seed, {"trainer": _manifest(triton.__version__, "t1", "t2")}, {})
    path = tmp_path / "run" / "triton_kernels.json"
    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        logged = []
        rec, st = P.start(path, workers=1, log=logged.append, seed=seed, role="trainer")
        rec.uninstall()
        assert st["seed"]["new"] == 2 and st["preloaded"] == 0 and "driver" in next(iter(st["skipped"])), st
        assert len(P.load(path)["entries"]) == 2 and "2 of its 2 entries new" in logged[0], logged
        rec, st = P.start(tmp_path / "none.json", workers=1, log=logged.append)
        rec.uninstall()
        assert st is None and not (tmp_path / "none.json").exists()
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old


def test_a_seed_is_not_made_from_a_seeded_run_unless_asked(tmp_path):
    """scripts/make_kernel_seed.py: a loop whose arm ran with the recipe's seed merged (grpo_qwen3_gpu's default) is
    refused, naming the override that records a clean one; with that override the seed is written; with
    --allow-seeded too, and it names the seed it inherited (session 47: a seeded run's manifests carry the old seed's
    stale entries forward)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_kernel_seed as M

    tv = triton.__version__
    man = tmp_path / "t_kernel_manifests.json"
    man.write_text(json.dumps({"strict": {"triton_kernels.json": _manifest(tv, "t1"),
                                          "triton_kernels_vllm-0.json": _manifest(tv, "e1")}}))

    def report(*overrides):
        r = tmp_path / "t.json"
        r.write_text(json.dumps({"recipe": "grpo_qwen3_gpu", "device": "x", "overrides": {"strict": list(overrides)}}))
        return ["--report", str(r)]

    out = tmp_path / "s.json.gz"
    with pytest.raises(SystemExit, match=r"kernel_manifest_seed=kernel_manifests/grpo_qwen3_gpu\.json\.gz.*"
                                         r"strict:trainer\.kernel_manifest_seed=null"):
        M.main([str(man), *report("trainer.profile_update=10"), "--out", str(out)])
    assert not out.exists()
    assert M.main([str(man), *report("trainer.kernel_manifest_seed=null"), "--out", str(out)]) == 0
    assert "seeded_from" not in P.load_seed(out)["recorded"]
    assert M.main([str(man), *report(), "--out", str(out), "--allow-seeded"]) == 0
    doc = P.load_seed(out)
    assert doc["recorded"]["seeded_from"] == "kernel_manifests/grpo_qwen3_gpu.json.gz"
    assert {r: len(m["entries"]) for r, m in doc["roles"].items()} == {"trainer": 1, "engine": 1}


def _with_constexpr(data: str, name: str, value) -> str:
    obj = json.loads(data)
    i = list(obj["signature"]).index(name)
    obj["constant_vals"][obj["constant_keys"].index([i])] = value
    return json.dumps(obj)


def test_entries_the_contract_no_longer_launches_are_skipped_and_left_out_of_seeds(tmp_path):
    """An attention entry specialised for another KV split than the contract's (attention v1's SEG_CHUNKS 8 x 64 keys
    under v2's 2,048) is contract-stale: `usable` (what the workers and the preload compile) skips it with its reason,
    a worker compiles nothing for it, and make_kernel_seed drops it and counts it. The same entry at the contract's
    split, and a GEMM entry, are kept. Real entries: the shipped seed's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_kernel_seed as M
    from rlkernel.backends.triton.contracts import ATTENTION

    seed = P.load_seed(ROOT / "recipes" / "kernel_manifests" / "grpo_qwen3_gpu.json.gz")
    entries = seed["roles"]["trainer"]["entries"]
    attn = next(e for e in entries if e["kernel"].endswith("._attn_fwd"))
    gemm = next(e for e in entries if "SEG_CHUNKS" not in P.constexprs(e["data"]))
    named = P.constexprs(attn["data"])
    assert named["SEG_CHUNKS"] * named["BLOCK_N"] == ATTENTION.seg_keys and P.contract_stale(attn["data"]) is None
    assert P.contract_stale(gemm["data"]) is None
    stale = {**attn, "key": "stale", "data": _with_constexpr(attn["data"], "SEG_CHUNKS", 512 // named["BLOCK_N"])}
    why = f"a 512-key KV split, the attention contract's is {ATTENTION.seg_keys}"
    assert P.contract_stale(stale["data"]) == why
    kept, skipped = P.usable([attn, stale, gemm], "sm90")
    assert kept == [attn, gemm] and skipped == {why: 1}

    man = tmp_path / "m.json"
    man.write_text(json.dumps({"format": P.FORMAT, "triton": triton.__version__, "entries": [stale]}))
    got = P.compile_share(man, "cuda:90:32", 0, 1)
    assert got["compiled"] == 0 and got["skipped"] == {why: 1}

    loop = tmp_path / "t_kernel_manifests.json"
    loop.write_text(json.dumps({"strict": {"triton_kernels.json": {"format": P.FORMAT, "triton": triton.__version__,
                                                                   "entries": [attn, stale, gemm]}}}))
    report = tmp_path / "t.json"
    report.write_text(json.dumps({"recipe": "grpo_qwen3_gpu",
                                  "overrides": {"strict": ["trainer.kernel_manifest_seed=null"]}}))
    out = tmp_path / "s.json.gz"
    assert M.main([str(loop), "--report", str(report), "--out", str(out)]) == 0
    assert [e["key"] for e in P.load_seed(out)["roles"]["trainer"]["entries"]] == [attn["key"], gemm["key"]]


def test_the_shipped_seed_fits_this_checkout():
    """The GPU recipe's seed (recipes/kernel_manifests/grpo_qwen3_gpu.json.gz, recorded on an H100): both roles, sm_90,
    Triton 3.6; every entry names a kernel of this checkout whose parameters are the recorded signature's, deserialises
    as the preload does, and is one the contracts still launch (`contract_stale`). A kernel renamed or re-parametrised
    since fails here: re-record the seed (`gpu_session.py loop_qwen3_native loop_qwen3_strict_seed` on a GPU, then
    `scripts/make_kernel_seed.py`), else a fresh machine compiles it cold."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    doc = P.load_seed(ROOT / "recipes" / "kernel_manifests" / "grpo_qwen3_gpu.json.gz")
    assert sorted(doc["roles"]) == ["engine", "trainer"] and doc["recorded"]["recipe"] == "grpo_qwen3_gpu"
    backend = make_backend(GPUTarget("cuda", 90, 32))
    for role, m in doc["roles"].items():
        assert m["triton"].startswith("3.6") and len(m["entries"]) >= 40, (role, m["triton"], len(m["entries"]))
        mine, other = P.for_arch(m["entries"], "sm90")
        assert not other and len(mine) == len(m["entries"]), other
        for e in m["entries"]:
            fn, why = P._resolve(e["kernel"])
            assert fn is not None, why
            assert list(json.loads(e["data"])["signature"]) == [p.name for p in fn.params], e["kernel"]
            P._source(fn, e["data"], backend)  # raises where the recorded constexprs no longer fit
            assert P.contract_stale(e["data"]) is None, (e["kernel"], P.contract_stale(e["data"]))


_GROUP = """
import json, sys, time
import torch.distributed as dist
import torch.multiprocessing as mp
from rlkernel.backends.triton import precompile as P

def rank_main(rank, path, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = []
    def barrier():
        calls.append(time.monotonic())
        dist.barrier()
    logged = []
    rec, st = P.start_group(path, rank, 2, barrier, workers=2, log=logged.append)
    rec.uninstall()
    json.dump({"barriers": len(calls), "autosave": rec.autosave is not None, "stats": st, "logged": logged},
              open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=tuple(sys.argv[1:]), nprocs=2)
"""


@pytest.mark.skipif(_has_cuda(), reason="the case is a machine without a GPU driver")
def test_a_group_compiles_once_on_rank_0_and_every_rank_passes_the_barrier(tmp_path):
    """start_group (a TP / CP trainer, a TP engine), two real gloo ranks: each calls the barrier exactly once, also when
    rank 0's compile-ahead fails (here: no GPU driver to name the target) — a rank left waiting would hang the run;
    rank 0 alone records into the manifest and logs; both report the failure in their stats instead of raising."""
    path = tmp_path / "m.json"
    P.save_entries(path, {("rlkernel.backends.triton.norm._rmsnorm_kernel", "k"): "{}",
                          ("rlkernel.backends.triton.norm._rmsnorm_kernel", "k2"): "{}"})
    script = tmp_path / "group.py"
    script.write_text(_GROUP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "store"), str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert r0["barriers"] == r1["barriers"] == 1
    assert r0["autosave"] and not r1["autosave"]
    assert r0["logged"] and not r1["logged"]
    for r in (r0, r1):
        assert r["stats"]["preloaded"] == 0 and any("driver" in k for k in r["stats"]["skipped"]), r["stats"]
    # the device's target is asked once, before any entry: rank 0's stats add its worker fill's failure to its
    # preload's, rank 1 has the preload's only
    (reason0, n0), = r0["stats"]["skipped"].items()
    (reason1, n1), = r1["stats"]["skipped"].items()
    assert reason0 == reason1 and "driver" in reason0 and (n0, n1) == (2, 1), (r0["stats"], r1["stats"])


def test_the_strict_kernels_compile_for_sm80_and_sm100(tmp_path):
    """Portability, as far as a CPU can tell (README "other NVIDIA GPUs"): one specialization of each kernel the H200
    recorded for a strict forward + backward + logprob head (session 29's manifest) compiles for sm_80 (A100) with
    mma.sync and for sm_100 (B200) with tcgen05 — so the entries were re-targeted, not compiled as the sm90 they were
    recorded as (which aborts: the test above) — and the Gluon prefill, sm_90 only, is skipped with its reason."""
    if sm90_toolchain_missing():
        pytest.skip(f"this Triton cannot compile for these targets here: {sm90_toolchain_missing()}")
    manifest = ROOT / "benchmarks" / "h200_session29" / "call3" / "precompile_manifest.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "scripts/arch_compile_check.py", str(manifest), "--one-per-kernel", "--targets",
                        "cuda:80:32,cuda:100:32"], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    res = json.loads(p.stdout[p.stdout.index("{"):])
    kernels = {e["kernel"] for e in P.load(manifest)["entries"]}
    gluon = {k for k in kernels if "gluon" in k}
    assert len(kernels) == 16 and len(gluon) == 1, sorted(kernels)
    for r, mma in zip(res["targets"], ("mma.sync", "tcgen05")):
        assert r["failures"] == {} and r["compiled"] == len(kernels) - 1, r
        assert list(r["skipped"]) == ["attention_gluon._prefill_kernel: Gluon, sm_90 only (its gate keeps it off here)"]
        assert set(r["mma"]) == {mma} and r["kernels"]["gemm._gemm_kernel"]["mma"] == [mma], r["mma"]
