#!/usr/bin/env python3
"""The strict attention prefill's Gluon kernel (rlkernel/backends/triton/attention_gluon.py) on the H200: bit-checked
against the Triton kernel (`attention._attn_fwd`, RLKERNEL_ATTENTION_GLUON's other side), timed against it and SDPA,
with its scheduling knobs and two measurement-only variants that show where its time goes.

History: session 27 wrote the kernel here first, as an experiment with more knobs (calls 2-4,
benchmarks/h200_session27/call2..call4, this script at commit 7044658): one consumer warpgroup per CTA
(0.57-0.68x the Triton kernel: one CTA per SM), two sharing a K / V stream (0.95-1.00x), O in shared memory (0.82-0.86x:
8-way bank conflicts on the wgmma layout's rows; padded rows did not fit 4 stages), the next chunk's q.k^T issued
before the softmax (no gain), ping-pong (1.00-1.05x) and, with the mask only on partial chunks, 1.045x (1.08x at the
0.6B heads) — every variant bit-equal to production on a 12-request mixed-length batch. The library took the last.

    python3 scripts/gpu_gluon_attn.py --compile-only       # any machine: compile the variants for sm_90, ptxas usage
    python3 scripts/gpu_gluon_attn.py --out DIR            # an H200: bits vs the Triton kernel, time vs it and SDPA
    python3 scripts/gpu_gluon_attn.py --out DIR --cases q8b_16x256,q8b_4x1024 --variants production
                                                           # the small batches, where the host's time shows: host_us

Each timed case's `host_us` is the host's microseconds per call (a CPU clock over back-to-back calls, no sync: the GPU
runs behind) of the library call on the Gluon kernel through launch.py's fast path, the same through Triton's own
`JITFunction.run` (launch.fast_path(False)), the library call on the Triton kernel, and `attention_gluon.launch` alone;
`fast_path` checks that the fast path runs the very compiled kernel Triton's own launch picks (attention_gluon.verify)
and that both write the same bits (torch.equal, outputs and lse). `library_gluon_as_session28` is the library call as
session 28 launched it (a fresh layout, Triton's own run, each call). Cases of at most 4,096 tokens add a cProfile of
one library call on either kernel (`host_profile`: where the host's time goes).

Writes DIR/h200_gluon_attn.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402

from rlkernel.backends.triton import attention_gluon as AG  # noqa: E402

T0 = time.time()
# "sink": every query's largest logit is its sequence's first key (q and k share a direction there), as trained
# models' attention sinks make it: no row's max moves after chunk 0, the case skip_rescale is for. The small batches
# (16 x 256, 4 x 1,024) are where the host's time per call shows (session 28 call 1: 4 x 1,024 through the library
# took 0.328 ms on the Gluon kernel, 0.210 on the Triton kernel, 0.169 for the Gluon kernel's launch alone)
CASES = {"q8b_8x4096": ([4096] * 8, 32, 8, 128),
         "q8b_8x4096_sink": ([4096] * 8, 32, 8, 128),
         "q8b_varlen_bits": ([4096, 77, 1000, 2049, 513, 511, 3333, 1, 16, 17, 64, 65], 32, 8, 128),
         "q8b_4x1024": ([1024] * 4, 32, 8, 128),
         "q8b_16x256": ([256] * 16, 32, 8, 128),
         "q06_8x4096": ([4096] * 8, 16, 8, 128),
         # (session 42) where the three-consumer kernel starts to pay (attention_gluon.THREE_FROM), and a packed batch
         # of mixed lengths as an RL scoring forward sees it (the rule picks by the longest request)
         "q8b_8x1536": ([1536] * 8, 32, 8, 128),
         "q8b_4x2048": ([2048] * 4, 32, 8, 128),
         "q8b_4x3072": ([3072] * 4, 32, 8, 128),
         "q8b_mixed16": ([3900, 310, 2750, 1200, 640, 4096, 2048, 980, 1777, 256, 3300, 1500, 2600, 700, 3600, 1100],
                         32, 8, 128)}
# name -> attention_gluon.launch knobs; "production" is what attention_varlen runs. diag_* are measurement only
# (other bits): without the softmax, without q.k^T
VARIANTS = {
    "production": {},  # the library's choice (attention_gluon.consumers_for): since session 42 three consumers where the
    #                    longest request has >= 1,536 tokens, else two; compile_sm90 compiles the three-consumer kernel
    # the two-consumer kernel (`_prefill_kernel`, the library's in sessions 27-41) and its knobs
    "two": dict(consumers=2),
    "three": dict(consumers=3),  # the three-consumer kernel at any length (attention_gluon3)
    "stages3": dict(consumers=2, stages=3),
    "mask_every_chunk": dict(consumers=2, nfull=0),
    "skip_rescale": dict(consumers=2, skip=1),
    # (sessions 36-40 ran three consumer warpgroups a CTA, `_prefill3_kernel`: "three" (O in registers, spills),
    # "three_ows" / "three_ows_pdef160" (O in global slots held by a lock: 0.65 / 0.71x SDPA), "three_osm_k2" /
    # "three_osm_k2v3" (O in shared memory, K and V in rings of their own: 0.93-0.99x production; "three_osm_k3", K 3 +
    # V 2, faults), "three_osm_fold" / "three_osm_fold_k3" (the fold after the turn's q.k^T, O in column halves:
    # 0.99-1.01x), and "diag_three_nofold" / "diag_osm_nofold" (no folds, other bits: 1.10-1.18x) — every version
    # bit-equal on an H100, none faster once the folds run (all three consumers fold at the same chunk). The kernel and
    # these variants are at commit 6fcfcb8; "three_osm_fold_z" (1.01x the fold) and "zskip" (SKIP 2 here, 0.92-0.96x)
    # at b893719)
    "diag_nofold": dict(consumers=2, diag=3),
    "diag_three_nofold": dict(consumers=3, diag=3),  # (session 42) the library's kernel without folds: other bits
    "qreg": dict(consumers=2, qreg=1),
    "qk_first": dict(consumers=2, qk_first=1),
    "qreg_qk_first": dict(consumers=2, qreg=1, qk_first=1),
    "qreg_qk_first_s3": dict(consumers=2, qreg=1, qk_first=1, stages=3),
    # (session 34 call 1 also ran "persist" — one CTA per SM walking the work items, 0.85x — and "ostore", the output
    # tile in 16-byte stores, 1.08-1.09x, production since; the knobs are at commit 11899d9)
    # (session 35 call 11 ran "nbturn": the consumers' turn as named barriers 4 / 5 by inline bar.sync / bar.arrive, FA3's
    # scheduler barrier — bit-equal, 0.94-0.95x production in A/B rounds; the knob is at commit 13ab284)
    # (session 36 call 1 ran "wskip": the acc rescale skipped per warp — a vote on the warp's rows' alpha, then the 64
    # FMULs on a branch the warp takes or skips, by inline PTX — bit-equal, 0.93-0.95x production in A/B rounds on an
    # H100, 1.01x on the sink case; its code is at commit a7df753)
    # (session 35 call 12 ran "dyn": one CTA per SM taking the grid's work items in the grid's order from an atomic
    # counter, the producer handing each to the consumers through shared memory — bit-equal, 0.98-0.99x in A/B rounds,
    # 0.92x at 4 x 1,024; its code is at commit 3a1ed3f)
    # (session 41 ran "pair" / "pair_hand1" / "pair_tree" — attention_gluon_pair: 128-key K / V stages, two chunks'
    # q.k^T as one m64n128 chain a turn, the pair's two p.v split by the second chunk's rescale — and "maxtree", the
    # chunk's row max as a register tree: every one bit-equal, 0.95-1.03x production; the code is at commit 97b00f4)
    "diag_no_softmax": dict(consumers=2, diag=1),
    "diag_no_softmax_qreg": dict(consumers=2, diag=1, qreg=1),
    "diag_no_qk": dict(consumers=2, diag=2),
    # (session 41 also ran "rescale_in_turn", chunk c's acc * alpha moved into turn c + 1 beside its q.k^T — SKIP 3,
    # bit-equal, 0.955-0.995x — with its timeline "diag_trace_rit": code at commit d98ca3a)
    "diag_trace": dict(consumers=2, diag=4),  # (session 41) production's bits, a %clock64 timeline instead of the lse (trace_run)
}


def compile_sm90(variant, G=4, d=128, seg_chunks=None):
    """Compile a variant for sm_90 here (no GPU needed): the CompiledKernel. seg_chunks: the split in chunks (default:
    the contract's)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from rlkernel.backends.triton import contracts as C

    kw = {**dict(stages=AG.STAGES, nfull=1, diag=0, skip=0, qreg=AG.QREG, qk_first=AG.QK_FIRST), **VARIANTS[variant]}
    desc = f"tensordesc<bf16[64, {d}],{AG.kv_layout(64, d)!r}>"  # the descriptors' layout, as the library makes it
    ptrs = {"q_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32", "k_desc": desc, "v_desc": desc, "qs_ptr": "*i32",
            "ql_ptr": "*i32", "kl_ptr": "*i32", "ks_ptr": "*i32"}
    ints = {"sqt": "i32", "sqh": "i32", "sot": "i32", "soh": "i32", "qk_scale": "fp32"}
    seg_chunks = seg_chunks or C.ATTENTION.seg_keys // 64
    if (kw.get("consumers") or AG.CONSUMERS or 3) == 3:  # attention_gluon3._prefill3_kernel (production: the
        # library's kernel for long requests under auto)
        from rlkernel.backends.triton import attention_gluon3 as AG3
        const = dict(G=G, BLOCK_M=64, BLOCK_N=64, D=d, SEG_CHUNKS=seg_chunks, KS=AG3.KSTAGES, VS=AG3.VSTAGES,
                     STORE_LSE=True, NFULL=kw["nfull"], DIAG=kw["diag"], num_warps=4)
        sig = {**ptrs, **ints, "n_groups": "i32", **{k: "constexpr" for k in const}}
        src = GluonASTSource(AG3._prefill3_kernel, sig, constexprs=const)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
    const = dict(G=G, BLOCK_M=64, BLOCK_N=64, D=d, SEG_CHUNKS=seg_chunks, STAGES=kw["stages"], STORE_LSE=True,
                 NFULL=kw["nfull"], DIAG=kw["diag"], SKIP=kw["skip"], QREG=kw["qreg"], QK_FIRST=kw["qk_first"],
                 num_warps=4)
    sig = {**ptrs, **ints, "n_pairs": "i32", **{k: "constexpr" for k in const}}
    src = GluonASTSource(AG._prefill_kernel, sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})


def ptxas_usage(ptx: str) -> str:
    """ptxas -v's register / spill line for the kernel (Triton's bundled ptxas; no GPU needed)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True)
    lines = [ln.split("info    : ")[-1] for ln in (r.stdout + r.stderr).splitlines() if re.search(r"registers|spill|C75", ln)]
    return " | ".join(lines)


def ptx_facts(kernel) -> dict:
    import re
    ptx = kernel.asm["ptx"]
    return {"setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "ptxas": ptxas_usage(ptx),
            "wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "shared_bytes": kernel.metadata.shared,
            "warps": kernel.metadata.num_warps}


def direct_args(q, k, v, cu, max_seqlen, lse=None, cfg=None) -> tuple:
    """attention_gluon.launch's positional arguments for attention_varlen's packed call (bf16; the contract's tiles, or
    cfg's), with a fresh output."""
    import torch
    from rlkernel.backends.triton import contracts as C

    cfg = cfg or C.ATTENTION
    G = q.shape[1] // k.shape[1]
    q_start = cu[:-1].contiguous()
    q_len = (cu[1:] - cu[:-1]).contiguous()
    n_tiles = -(-max_seqlen // (cfg.block_m // G))
    return (q, k, v, torch.empty_like(q), q_start, q_len, q_len, q_start, n_tiles, q.shape[-1] ** -0.5, cfg,
            k.stride(0), lse)


def gluon_varlen(q, k, v, cu, max_seqlen, variant, lse=None):
    """attention_varlen's Gluon launch with a variant's knobs."""
    return AG.launch(*direct_args(q, k, v, cu, max_seqlen, lse), **VARIANTS[variant])


def host_us(fns: dict, n: int = 50, rounds: int = 15) -> dict:
    """Host microseconds per call of each fn in `fns` (name -> (fn, fast): fast False runs it under
    launch.fast_path(False), Triton's own launch): n back-to-back calls on a CPU clock with no sync inside (the GPU runs
    behind: n is small enough that the launch queue never fills and blocks the host), the fns' rounds interleaved (a
    drift of the host's speed reaches all alike), the median of `rounds` rounds, each started after a sync."""
    import contextlib
    import statistics

    import torch
    from rlkernel.backends.triton import launch as LA

    ts = {name: [] for name in fns}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (fn, fast) in fns.items():
            with contextlib.nullcontext() if fast else LA.fast_path(False):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                if r:
                    ts[name].append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return {name: round(statistics.median(t), 1) for name, t in ts.items()}


def host_profile(fn, n: int = 200, top: int = 12) -> list:
    """cProfile of n calls of fn: the `top` functions by own time, per call (where the host's time goes)."""
    import cProfile
    import pstats

    import torch

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    # stats: (file, line, name) -> (primitive calls, calls, own seconds, cumulative seconds, callers)
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"fn": f"{Path(f).name}:{line}({name})", "calls": round(nc / n, 2), "own_us": round(tt / n * 1e6, 2),
             "cum_us": round(ct / n * 1e6, 2)} for (f, line, name), (_, nc, tt, ct, _) in rows]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def _triton_kernel(fn):
    """fn() with attention_varlen on the Triton kernel (RLKERNEL_ATTENTION_GLUON=0 within the call): the reference."""
    with AG.off():
        return fn()


def _smi() -> dict:
    import subprocess
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
    return {"t": round(time.time() - T0, 1), "smi": r.stdout.strip()}


def packed_inputs(B: int, L: int, hq: int = 32, hkv: int = 8, d: int = 128):
    """B requests of L tokens, packed (seed 0, bf16, on the GPU): q, k, v, cu_seqlens and SDPA's [B, H, L, d] views."""
    import torch

    torch.manual_seed(0)
    q = torch.randn(B * L, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B * L, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device="cuda")
    return q, k, v, cu, tuple(x.view(B, L, -1, d).transpose(1, 2) for x in (q, k, v))


def _sha(t) -> str:
    """The first 16 hex digits of a tensor's bytes' SHA-1 (bit patterns)."""
    import hashlib

    return hashlib.sha1(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def ab_run(n: int, out: Path, variants=()) -> int:
    """Is the Gluon kernel's gain larger than the spread of timing one kernel twice? Both kernels and SDPA in turn,
    n rounds, twice: on a rested card and after ~10 s of cuBLAS GEMMs (the strict harness times attention after its
    GEMM sweep: session 27 call 5 read 2.83 ms there against 2.43 in this script)."""
    import statistics

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench
    from rlkernel.backends.triton import attention as A

    L = 4096
    q, k, v, cu, (qb, kb, vb) = packed_inputs(8, L)
    fns = {"triton": lambda: _triton_kernel(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L)),
           "library_gluon": lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L),
           "sdpa": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)}
    for var in variants:  # the library's kernel with a variant's knobs (its bits checked against the Triton kernel)
        fns[var] = lambda var=var: gluon_varlen(q, k, v, cu, L, var)
    res_bits = {}
    if variants:
        ref = _triton_kernel(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L))
        res_bits = {var: bool(torch.equal(fns[var](), ref)) for var in variants}
        res_sha = {var: _sha(fns[var]()) for var in ["library_gluon", *variants]}  # variants equal to each other
    res = {"device": torch.cuda.get_device_name(), "rounds": n, "phases": {}, "variants_equal_triton": res_bits,
           "variants_sha": res_sha if variants else {}}
    for phase in ("rested", "after_gemm_load"):
        if phase == "after_gemm_load":
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            t1 = time.time()
            while time.time() - t1 < 10:
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize()
            del a
        times = {name: [] for name in fns}
        clocks = [_smi()]
        for _ in range(n):
            for name, fn in fns.items():
                times[name].append(round(do_bench(fn, warmup=10, rep=60), 4))
            clocks.append(_smi())
        med = {name: statistics.median(t) for name, t in times.items()}
        res["phases"][phase] = {"ms": times, "median_ms": med, "clocks": clocks,
                                "spread_ms": {name: round(max(t) - min(t), 4) for name, t in times.items()},
                                "library_vs_triton": round(med["triton"] / med["library_gluon"], 3),
                                "library_vs_sdpa": round(med["sdpa"] / med["library_gluon"], 3),
                                "triton_vs_sdpa": round(med["sdpa"] / med["triton"], 3),
                                # per-round ratios' medians: a drift of the card's clock between rounds cancels
                                "vs_sdpa_rounds_median": {name: round(statistics.median(
                                    [s_ / t_ for s_, t_ in zip(times["sdpa"], times[name])]), 3) for name in fns},
                                "vs_library_rounds_median": {name: round(statistics.median(
                                    [s_ / t_ for s_, t_ in zip(times["library_gluon"], times[name])]), 3)
                                    for name in fns}}
        log(phase, {kk: vv for kk, vv in res["phases"][phase].items() if kk != "clocks"})
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_gluon_attn_ab.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


def trace_run(out: Path) -> int:
    """Where a chunk's cycles go (session 41): production's kernel with DIAG 4 writes, for CTAs (0..3, 0, 0) — the
    pairs holding the latest tokens of request 0, kv head 0, at 8 x 4,096 — each chunk's %clock64 at the loop's top
    (t0), once the turn is held (t1), once its p.v and q.k^T are done (t2) and after its softmax (t3, approximate: the
    stamp waits for no value). Per consumer, medians over the steady chunks (8 .. n - 8) of: the wait for the stage and
    the turn (t1 - t0), the wgmmas from issue to done (t2 - t1), the rest (t3 - t2 and the next t0 - t2), and the
    period (t0 of chunk c + 1 - t0 of chunk c). Its output is checked equal to the library kernel's (the same bits)."""
    import statistics

    import torch
    from rlkernel.backends.triton import attention as A

    L = 4096
    q, k, v, cu, _ = packed_inputs(8, L)
    ref = A.attention_varlen(q, k, v, cu, max_seqlen=L)
    trace = torch.zeros(4 * 2 * 1024, dtype=torch.int64, device="cuda")
    for _ in range(3):  # compile, warm, then the run read below
        trace.zero_()
        y = gluon_varlen(q, k, v, cu, L, "diag_trace", trace.view(torch.float32))
    torch.cuda.synchronize()
    tr = trace.view(4, 2, 128, 8).cpu().tolist()
    res = {"device": torch.cuda.get_device_name(), "variant": "diag_trace", "equal_library": bool(torch.equal(y, ref)),
           "ctas": {}}
    med = lambda xs: int(statistics.median(xs))  # noqa: E731
    for cta in range(4):
        row = res["ctas"][cta] = {}
        for w in range(2):
            t = tr[cta][w]
            n = 1 + max((c for c in range(128) if t[c][0]), default=-1)  # the chunks stamped
            steady = range(8, max(9, n - 8))
            pick = [c for c in steady if c + 1 < n and all(t[c][:6]) and t[c + 1][0]]
            if not pick:
                row[w] = {"chunks": n}
                continue
            row[w] = {"chunks": n, "steady_chunks": len(pick),
                      "wait_stage_turn": med([t[c][1] - t[c][0] for c in pick]),
                      "wgmma_issue_to_done": med([t[c][2] - t[c][1] for c in pick]),
                      "softmax_to_stamp": med([t[c][3] - t[c][2] for c in pick]),
                      # inside the softmax (stamps that wait for the value): the row max, then exp2 and the row sum
                      "done_to_rowmax": med([t[c][4] - t[c][2] for c in pick]),
                      "rowmax_to_rowsum": med([t[c][5] - t[c][4] for c in pick]),
                      "rowsum_to_next_top": med([t[c + 1][0] - t[c][5] for c in pick]),
                      "done_to_next_top": med([t[c + 1][0] - t[c][2] for c in pick]),
                      "period": med([t[c + 1][0] - t[c][0] for c in pick]),
                      "raw_first_16": [[x - t[1][0] if x else None for x in t[c]] for c in range(1, min(n, 17))]}
            if w == 1 and isinstance(row.get(0), dict) and "period" in row[0]:  # the turn's offset between consumers
                row["offset_c1_minus_c0_t1"] = med([t[c][1] - tr[cta][0][c][1] for c in pick])
        log("trace cta", cta, {w: {kk: vv for kk, vv in r.items() if kk != "raw_first_16"} if isinstance(r, dict) else r
                               for w, r in row.items()})
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_gluon_attn_trace.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    ap.add_argument("--ab", type=int, default=0, help="only the A/B run: the Triton kernel, the library's (Gluon) and "
                                                       "SDPA timed in turn N times at 8 x 4,096, before and after a "
                                                       "heavy GEMM load, with the card's clocks read between")
    ap.add_argument("--ab-variants", default="", help="with --ab: VARIANTS also timed in each round")
    ap.add_argument("--trace", action="store_true", help="only trace_run: production's %%clock64 timeline (DIAG 4)")
    args = ap.parse_args(argv)
    if args.trace:
        return trace_run(Path(args.out))
    if args.ab:
        return ab_run(args.ab, Path(args.out), [x for x in args.ab_variants.split(",") if x])
    names = [n for n in args.variants.split(",") if n]
    res = {"triton": triton.__version__, "compiled_sm90": {}}
    for name in names:
        try:
            res["compiled_sm90"][name] = ptx_facts(compile_sm90(name))
        except Exception as e:  # noqa: BLE001 -- a variant this Triton cannot build is recorded
            res["compiled_sm90"][name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        log(name, json.dumps(res["compiled_sm90"][name]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compile_only:
        return 0 if all("error" not in v for v in res["compiled_sm90"].values()) else 1
    import torch
    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
        (out / "h200_gluon_attn.json").write_text(json.dumps(res, indent=1) + "\n")
        return 0
    import torch.nn.functional as F
    from triton.testing import do_bench
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton import contracts as C
    from rlkernel.backends.triton import launch as LA
    from triton.experimental.gluon import language as gl

    torch.manual_seed(0)
    res.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
               timer="triton.testing.do_bench (L2 flushed), median ms; TFLOP/s = causal FLOPs 2*2*B*Hq*L*L*D/2",
               host_timer="host_us: a CPU clock over back-to-back calls, no sync, median of rounds (host_us())",
               fast_launch=LA._fast_ok(), cases={})
    res["host_layout_us"] = host_us({  # what attention_gluon.kv_layout's cache saves a call, on this host
        "get_default_for": (lambda: gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16), True),
        "kv_layout": (lambda: AG.kv_layout(64, 128), True)}, n=1000, rounds=5)

    def bench(fn):
        return do_bench(fn, warmup=10, rep=60)

    cases = {c: CASES[c] for c in args.cases.split(",") if c}
    for cname, (lens, hq, hkv, d) in cases.items():
        T, L = sum(lens), max(lens)
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        if cname.endswith("_sink"):
            u = torch.randn(d, device="cuda")
            u = (u / u.norm()).to(torch.bfloat16)
            q += 8 * u
            k[cu[:-1].long()] += 16 * u  # each sequence's first key: q.k ~ 128 +- 16, the others' ~ N(0, 14^2)
        flops = sum(4 * hq * n * n * d / 2 for n in lens)
        timed = cname != "q8b_varlen_bits"
        row = res["cases"][cname] = {"lengths": lens, "hq": hq, "hkv": hkv, "d": d, "variants": {}}
        ref, ref_lse = _triton_kernel(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, split=False, return_lse=True))
        lib, lib_lse = A.attention_varlen(q, k, v, cu, max_seqlen=L, return_lse=True)  # what the library runs
        row["library_gluon"] = AG.unsupported_reason(q, k, C.ATTENTION, hq // hkv, d, paged=False, split=False,
                                                     tma=True, walk="flat") or "yes"
        row["library_equal_triton"] = bool(torch.equal(lib, ref))
        row["library_lse_equal_triton"] = bool(torch.equal(lib_lse, ref_lse))
        row["triton_split_equal"] = bool(torch.equal(_triton_kernel(
            lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L, split=True)), ref))
        with LA.fast_path(False):  # the library call again, the Gluon kernel launched by Triton's own JITFunction.run
            own, own_lse = A.attention_varlen(q, k, v, cu, max_seqlen=L, return_lse=True)
        fp = row["fast_path"] = {"equal_own_launch": bool(torch.equal(lib, own)),
                                 "lse_equal_own_launch": bool(torch.equal(lib_lse, own_lse))}
        if row["library_gluon"] == "yes":  # the fast path's kernel is the object Triton's own launch picks
            fp.update(AG.verify(*direct_args(q, k, v, cu, L, torch.empty_like(lib_lse))))
        if timed:
            t = bench(lambda: _triton_kernel(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L)))
            row["triton_ms"], row["triton_tflops"] = round(t, 4), round(flops / t / 1e9, 1)
            t = bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L))
            row["library_ms"], row["library_tflops"] = round(t, 4), round(flops / t / 1e9, 1)
            row["library_vs_triton"] = round(row["triton_ms"] / row["library_ms"], 3)
            with LA.fast_path(False):
                row["library_own_launch_ms"] = round(bench(lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L)), 4)
            direct = direct_args(q, k, v, cu, L)

            def call():
                return A.attention_varlen(q, k, v, cu, max_seqlen=L)

            row["host_us"] = host_us({
                "library_gluon": (call, True), "library_triton": (lambda: _triton_kernel(call), True),
                "direct_launch": (lambda: AG.launch(*direct), True), "library_gluon_own_launch": (call, False),
                "direct_launch_own_launch": (lambda: AG.launch(*direct), False),
                # as session 28 ran it: a fresh layout every launch, Triton's own launch
                "library_gluon_as_session28": (lambda: (AG._LAYOUTS.clear(), call()), False)})
            if T <= 4096:
                row["host_profile"] = {"library_gluon": host_profile(call),
                                       "library_triton": host_profile(lambda: _triton_kernel(call))}
            if len(set(lens)) == 1:
                B = len(lens)
                qb, kb, vb = (x.view(B, L, -1, d).transpose(1, 2) for x in (q, k, v))
                t = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
                row["sdpa_ms"], row["sdpa_tflops"] = round(t, 4), round(flops / t / 1e9, 1)
                row["triton_vs_sdpa"] = round(row["sdpa_ms"] / row["triton_ms"], 3)
                row["library_vs_sdpa"] = round(row["sdpa_ms"] / row["library_ms"], 3)
        log(cname, {kk: vv for kk, vv in row.items() if kk not in ("variants", "host_profile")})
        for name in names:
            rec = row["variants"][name] = {}
            if "error" in res["compiled_sm90"].get(name, {}):
                rec["error"] = "did not compile"
                continue
            try:
                lse = torch.empty(q.shape[:2], device="cuda", dtype=torch.float32)
                y = gluon_varlen(q, k, v, cu, L, name, lse)
                torch.cuda.synchronize()
                rec["equal_triton"] = bool(torch.equal(y, ref))
                rec["lse_equal_triton"] = bool(torch.equal(lse, ref_lse))
                if not rec["equal_triton"]:
                    diff = (y.float() - ref.float()).abs()
                    rec["rows_differ"] = int((diff.amax(dim=(1, 2)) > 0).sum())
                    rec["max_abs_diff"] = float(diff.max())
                rec["run_to_run_equal"] = bool(torch.equal(y, gluon_varlen(q, k, v, cu, L, name)))
                rec["out_sha"] = _sha(y)  # measurement variants of other bits compared with each other
                if timed:
                    t = bench(lambda: gluon_varlen(q, k, v, cu, L, name))
                    rec["ms"], rec["tflops"] = round(t, 4), round(flops / t / 1e9, 1)
                    rec["vs_triton"] = round(row["triton_ms"] / t, 3)
                    if "sdpa_ms" in row:
                        rec["vs_sdpa"] = round(row["sdpa_ms"] / t, 3)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(cname, name, rec)
            (out / "h200_gluon_attn.json").write_text(json.dumps(res, indent=1) + "\n")
        del q, k, v
        torch.cuda.empty_cache()
    res["library_kernel"] = AG.describe()  # the first-use checks' outcomes (one per query-head group seen)
    res["seconds"] = round(time.time() - T0, 1)
    (out / "h200_gluon_attn.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
