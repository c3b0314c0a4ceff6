#!/usr/bin/env python3
"""Compile-ahead on a cold machine (rlkernel/backends/triton/precompile.py), measured: three fresh processes, three empty
Triton caches, one strict workload.

    python3 scripts/gpu_precompile_check.py [--out DIR] [--layers 2] [--workers 16] [--phases record,ahead,threads]

  record    empty cache A: the workload (a strict trainer's kernels: packed forward + logprob head + backward at two
            packings, a scoring forward) with the recorder on; its first launches' seconds (the cold cost) and the
            manifest it writes;
  ahead     empty cache B: compile_ahead(manifest) first (--workers processes, then the preload), then the same
            workload: compile-ahead's wall time, the first launches' seconds left, and how many kernels the JIT still
            had to compile or load (the recorder's new entries during the workload; 0 when the manifest covered it);
  threads   empty cache C: the same with no worker processes, the preload's 16 threads alone (session 25's first
            version: 70 s for 114 s of serial compiles);
  group     empty cache D, two processes on the one GPU as a TP group would run (precompile.start_group, gloo
            barrier): rank 0's worker processes fill the cache, both preload, then both run the workload: each
            rank's compile-ahead seconds and compiles left (0 when the group path works), the same bits.
Every process hashes the workload's logprobs and gradients: preloaded kernels must give the bits the recording process
got (they are the kernels Triton's own JIT compiles for those specializations). Writes DIR/h200_precompile.json
(DIR: $OUT, else benchmarks/); without CUDA {"skipped": ...}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
Q06 = dict(hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128)


def workload(layers: int, dims: dict | None = None) -> str:
    """The strict trainer's kernels at the Qwen3-0.6B width: two packings of training forward + backward, one scoring
    forward. Returns a hash of every logprob and gradient."""
    import torch
    import gpu_strict_parity as P
    dims = dims or Q06
    dev = P.DEV
    model = P.build_model(layers, **dims)
    vocab = dims.get("vocab_size", P.QWEN3_8B["vocab_size"])
    h = hashlib.sha256()
    gen = torch.Generator(device=dev).manual_seed(3)
    for lens in ([700, 333, 1029], [96, 17, 512, 260, 1]):
        T = sum(lens)
        ids = torch.randint(0, vocab, (T,), device=dev, generator=gen)
        tg = torch.randint(0, vocab, (T,), device=dev, generator=gen)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        model.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        lp = model.logprobs(model.forward_packed(ids, cu), tg)
        lp.mean().backward()
        h.update(lp.detach().float().cpu().numpy().tobytes())
        for n, p in sorted(model.named_parameters()):
            if p.grad is not None:
                h.update(p.grad.float().cpu().numpy().tobytes())
        model.requires_grad_(False)
        with torch.no_grad():
            h.update(model.logprobs(model.forward_packed(ids, cu), tg).float().cpu().numpy().tobytes())
    if dev == "cuda":
        torch.cuda.synchronize()
    return h.hexdigest()[:16]


def child(args) -> dict:
    import torch  # noqa: F401
    from rlkernel.backends.triton import precompile
    from rlkernel.backends.triton.launch import first_launch_stats
    out = {"phase": args.child, "cache": os.environ.get("TRITON_CACHE_DIR")}
    if args.child == "group":  # one rank of two (a TP engine's or trainer group's start)
        import torch.distributed as dist
        rank = int(os.environ["GROUP_RANK"])
        dist.init_process_group("gloo", init_method=f"file://{os.environ['GROUP_STORE']}", rank=rank, world_size=2)
        out["rank"] = rank
        t0 = time.perf_counter()
        rec, out["ahead"] = precompile.start_group(args.manifest, rank, 2, dist.barrier, workers=args.workers,
                                                   log=lambda m: print(m, file=sys.stderr, flush=True))
        out["start_group_seconds"] = round(time.perf_counter() - t0, 2)
    else:
        rec = precompile.Recorder().install()
    if args.child in ("ahead", "threads"):
        workers = 1 if args.child == "threads" else args.workers
        out["ahead"] = precompile.compile_ahead(args.manifest, 16, workers)
    before = len(rec.entries)
    t0 = time.perf_counter()
    try:
        out["hash"] = workload(args.layers)
    finally:  # the manifest is kept even if the workload fails after compiling
        out["workload_seconds"] = round(time.perf_counter() - t0, 2)
        out["first_launches"] = first_launch_stats()
        out["jit_compiles_or_loads_in_workload"] = len(rec.entries) - before if args.child != "record" else len(rec.entries)
        if args.child == "record":
            out["manifest_new_entries"] = rec.save(args.manifest)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--child", choices=("record", "ahead", "threads", "group"))
    ap.add_argument("--manifest")
    ap.add_argument("--phases", default="record,ahead,threads,group", help="which of record, ahead, threads, group to run")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    out_path = Path(args.out) / "h200_precompile.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import torch
    if not torch.cuda.is_available():
        out_path.write_text(json.dumps({"skipped": "no CUDA device"}) + "\n")
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    res = {"device": torch.cuda.get_device_name(), "cpus": os.cpu_count(), "layers": args.layers, "phases": {}}
    tmp = Path(tempfile.mkdtemp(prefix="precompile_"))
    manifest = tmp / "triton_kernels.json"
    def finished(p, t0) -> dict:
        out, err = p.communicate(timeout=900)
        rec = {"rc": p.returncode, "process_seconds": round(time.perf_counter() - t0, 1)}
        try:
            rec.update(json.loads(out.strip().splitlines()[-1]))
        except Exception:  # noqa: BLE001
            rec["stderr_tail"] = err[-2500:]
        return rec

    for phase in ("record", "ahead", "threads", "group"):
        if phase not in args.phases.split(","):
            continue
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp / f"cache_{phase}")}
        path = manifest
        if phase == "group":  # its rank 0 records into its manifest: a copy, so the phases stay independent
            path = tmp / "triton_kernels_group.json"
            path.write_bytes(manifest.read_bytes())
        cmd = [sys.executable, __file__, "--child", phase, "--manifest", str(path), "--workers", str(args.workers),
               "--layers", str(args.layers)]
        t0 = time.perf_counter()
        if phase == "group":
            procs = [subprocess.Popen(cmd, env={**env, "GROUP_RANK": str(r), "GROUP_STORE": str(tmp / "group_store")},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
            rec = {"ranks": [finished(p, t0) for p in procs]}
        else:
            rec = finished(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), t0)
        res["phases"][phase] = rec
        print(phase, json.dumps(rec)[:1500], flush=True)
    ph = res["phases"]
    try:
        entries = json.loads(manifest.read_text())["entries"]
        res["manifest_entries"] = len(entries)
        # what bounds compile-ahead (session 27: ~70 s with 16 processes or 16 threads alike): the longest compiles
        # as the recording process timed them, and the manifest itself beside this JSON
        res["slowest_compiles"] = [(e["kernel"], e.get("seconds")) for e in
                                   sorted(entries, key=lambda e: -(e.get("seconds") or 0))[:8]]
        res["kernels_by_module"] = dict(Counter(e["kernel"].rsplit(".", 1)[0] for e in entries))
        (Path(args.out) / "precompile_manifest.json").write_text(manifest.read_text())
        cold = ph["record"]["first_launches"]["seconds"]
        res["summary"] = {
            "cold_first_launch_seconds": round(cold, 2),
            "ahead_seconds": ph["ahead"]["ahead"]["seconds"], "ahead_workers": ph["ahead"]["ahead"]["workers"],
            "ahead_worker_seconds": ph["ahead"]["ahead"]["worker_seconds"],
            "ahead_preload_seconds": ph["ahead"]["ahead"]["preload_seconds"],
            "after_ahead_first_launch_seconds": round(ph["ahead"]["first_launches"]["seconds"], 2),
            "cold_to_ahead": round(cold / max(ph["ahead"]["ahead"]["seconds"]
                                              + ph["ahead"]["first_launches"]["seconds"], 1e-9), 2),
            "jit_compiles_left_after_ahead": ph["ahead"]["jit_compiles_or_loads_in_workload"],
            "bits_equal": len({ph[k]["hash"] for k in ph if k != "group"}) == 1,
            "skipped": ph["ahead"]["ahead"]["skipped"]}
        if "threads" in ph:
            res["summary"]["threads_only_ahead_seconds"] = ph["threads"]["ahead"]["seconds"]
            res["summary"]["processes_vs_threads"] = round(ph["threads"]["ahead"]["seconds"]
                                                           / max(ph["ahead"]["ahead"]["seconds"], 1e-9), 2)
    except Exception as e:  # noqa: BLE001
        res["summary_error"] = f"{type(e).__name__}: {e}"
    if "group" in ph:
        try:  # apart: a failed group phase keeps the summary above
            g = ph["group"]["ranks"]
            res["group_summary"] = {
                "start_group_seconds": [r["start_group_seconds"] for r in g],
                "rank0_worker_seconds": g[0]["ahead"]["worker_seconds"],
                "jit_compiles_left": [r["jit_compiles_or_loads_in_workload"] for r in g],
                "first_launch_seconds": [round(r["first_launches"]["seconds"], 2) for r in g],
                "bits_equal_to_record": all(r["hash"] == ph["record"]["hash"] for r in g)}
        except Exception as e:  # noqa: BLE001
            res["group_summary_error"] = f"{type(e).__name__}: {e}"
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"precompile": res.get("summary", res.get("summary_error")),
                      "group": res.get("group_summary", res.get("group_summary_error"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
