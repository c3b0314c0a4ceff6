#!/usr/bin/env python3
"""The attention contract's KV split size (`seg_keys`) as the lever on the prefill (session 42): the Gluon prefill
kernels at seg_keys 512 (the contract since session 12) and larger, bit-checked against the Triton kernel at the
same tiles and timed against SDPA; the paged decode at the same sizes.

Why: every schedule of the 64-key chunk's softmax was measured (sessions 33-41) without a gain; the one measured
lever was the segment folds. Three consumer warpgroups a CTA ran 1.10-1.18x the two-consumer kernel without the
folds and ~1.0x with them (sessions 36-40), because all three fold at every 512th key. A larger split size is a
contract change (other bits for sequences longer than 512 keys, the same properties: prefill == decode == chunked
prefill, a fixed split size); its cost is the paged decode's parallelism at small batches (fewer splits a sequence).

    python3 scripts/gpu_attn_seg.py --out DIR [--segs 512,2048,4096] [--variants two,three_osm_fold,...] [--rounds 3]
    python3 scripts/gpu_attn_seg.py --compile-only   # any machine: compile the variants for sm_90, ptxas usage

Writes DIR/h200_attn_seg.json. Without CUDA (and not --compile-only): {"skipped": reason}, exit 0.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
T0 = time.time()

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_gluon_attn as GA  # noqa: E402  (its variants, sm_90 compile, direct launch arguments and hashes)

# gpu_gluon_attn's variants compared here: the two-consumer kernel, the three-consumer kernel (the library's for long
# requests since session 42), and the latter without segment folds (diag 3: other bits, the ceiling). Session 42's
# calls 1-2 ran the three-consumer variants of commit 6fcfcb8 (copied beside the library for the call: "three" with O
# in registers, "three_ows" in held global slots, "three_osm_k2v3" in shared memory, "three_osm_fold" in shared memory
# with the fold beside the other consumers' MMAs — the one the library now runs, as attention_gluon3)
VARIANTS = {name: GA.VARIANTS[name] for name in ("two", "three", "diag_three_nofold")}
MIXED = [4096, 77, 1000, 2049, 513, 511, 3333, 1, 16, 17, 64, 65, 5000, 8200]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def compile_only(segs, variants) -> int:
    """Compile each variant at each split size for sm_90 here (no GPU needed): seconds, shared memory, ptxas usage."""
    for seg in segs:
        for name in variants:
            t = time.time()
            kern = GA.compile_sm90(name, seg_chunks=seg // 64)
            log(seg, name, f"{time.time() - t:.1f}s", "shared", kern.metadata.shared, GA.ptxas_usage(kern.asm["ptx"]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--segs", default="512,2048,4096")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-segs", default="512,1024,2048,4096", help="'' skips the decode sweep")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    segs = [int(s) for s in args.segs.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    if args.compile_only:
        return compile_only(segs, variants)
    out_path = Path(args.out) / "h200_attn_seg.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import torch
    if not torch.cuda.is_available():
        out_path.write_text(json.dumps({"skipped": "no CUDA device"}) + "\n")
        return 0
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench
    from rlkernel.backends.triton import attention as A
    from rlkernel.backends.triton import attention_gluon as AG
    from rlkernel.backends.triton import contracts as C
    direct_args = GA.direct_args

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "segs": segs, "variants": {v: VARIANTS[v] for v in variants}, "bits": {}, "timing": {}}

    def save():
        out_path.write_text(json.dumps(res, indent=1) + "\n")

    # bits: each variant at each seg against the Triton kernel at the same tiles (outputs and lse, bit patterns)
    gen = torch.Generator(device="cpu").manual_seed(42)
    lens = MIXED
    T = sum(lens)
    q = torch.randn(T, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(T, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(T, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    for seg in segs:
        cfg = replace(C.ATTENTION, seg_keys=seg)
        row = res["bits"][f"seg{seg}"] = {}
        with AG.off():
            ref, ref_lse = A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), split=False, return_lse=True,
                                              config=cfg)
        row["triton_sha"] = GA._sha(ref)
        if seg != 512:  # the v1 contract's split size
            with AG.off():
                r512 = A.attention_varlen(q, k, v, cu, max_seqlen=max(lens), split=False,
                                          config=replace(C.ATTENTION, seg_keys=512))
            row["rows_differing_from_seg512"] = int((r512.view(torch.int16) != ref.view(torch.int16)).any(-1).sum())
        for name in variants:
            try:
                lse = torch.empty(T, 32, device="cuda", dtype=torch.float32)
                a = direct_args(q, k, v, cu, max(lens), lse, cfg)
                y = AG.launch(*a, **VARIANTS[name])
                torch.cuda.synchronize()
                n_out = int((y.view(torch.int16) != ref.view(torch.int16)).any(-1).sum())
                n_lse = int((lse.view(torch.int32) != ref_lse.view(torch.int32)).sum())
                row[name] = {"rows_differ": n_out, "lse_differ": n_lse, "equal": n_out == 0 and n_lse == 0}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log("bits", seg, name, row[name])
        save()
    del q, k, v

    # timing: 8 x 4,096 (32 / 8 heads, the harness's case) and 2 x 16,384, interleaved rounds with SDPA
    for case, (B, L) in (("8x4096", (8, 4096)), ("2x16384", (2, 16384))):
        torch.manual_seed(0)
        q = torch.randn(B * L, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B * L, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32, device="cuda")
        qb, kb, vb = (x.view(B, L, -1, 128).transpose(1, 2) for x in (q, k, v))
        flops = 4 * B * 32 * L * L * 128 / 2
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)}
        fns["library"] = lambda: A.attention_varlen(q, k, v, cu, max_seqlen=L)  # the contract's tiles
        for seg in segs:
            cfg = replace(C.ATTENTION, seg_keys=seg)
            for name in variants:
                if "error" in res["bits"][f"seg{seg}"].get(name, {}):
                    continue
                a = direct_args(q, k, v, cu, L, None, cfg)
                fns[f"{name}_seg{seg}"] = lambda a=a, name=name: AG.launch(*a, **VARIANTS[name])
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
            for n, fn in fns.items():
                try:
                    times[n].append(do_bench(fn, warmup=10, rep=50))
                except Exception as e:  # noqa: BLE001
                    times[n].append(float("nan"))
                    log("timing error", n, type(e).__name__, str(e)[:200])
        med = {n: statistics.median(t) for n, t in times.items()}
        res["timing"][case] = {
            "median_ms": {n: round(t, 4) for n, t in med.items()},
            "tflops": {n: round(flops / t / 1e9, 1) for n, t in med.items()},
            "vs_sdpa_rounds_median": {n: round(statistics.median([s / t for s, t in zip(times["sdpa"], times[n])]), 3)
                                      for n in fns},
            "vs_library_rounds_median": {n: round(statistics.median(
                [s / t for s, t in zip(times["library"], times[n])]), 3) for n in fns}}
        log("timing", case, res["timing"][case]["vs_sdpa_rounds_median"])
        save()
        del q, k, v, qb, kb, vb

    # decode at each split size: the contracts sweep of gpu_attn_sweep (bits: decode == prefill, split == unsplit;
    # paged decode latency at batch 1 / 8 / 64 x 4,096 and 8 / 256 x 1,024 against SDPA on a contiguous cache)
    dsegs = [int(s) for s in args.decode_segs.split(",") if s]
    if dsegs:
        import gpu_attn_sweep as S
        S.CONTRACTS = [(64, s) for s in dsegs]
        sub = {}
        S.contracts(sub, lambda fn: do_bench(fn, warmup=10, rep=60), log)
        res["decode_contracts"] = sub["contracts"]
        save()
    res["elapsed_s"] = round(time.time() - T0, 1)
    save()
    log("done", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
