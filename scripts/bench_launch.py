#!/usr/bin/env python3
"""Host time per Triton launch: Triton's own `kernel[grid](...)` against rlkernel's fast path (`backends/triton/launch.py`),
side by side in one process, for the kernels a strict update launches most (the tree-sum reduction, RMSNorm forward
and backward, the GEMM). Each variant launches `--launches` times without synchronising (the host's cost, while the
device queue absorbs the work), alternating the two paths over `--rounds` rounds; the median per-launch microseconds
and their ratio (fast / Triton's) go to stdout as JSON and to --out/h200_launch_bench.json. Exits at once without CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--launches", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    import triton

    from rlkernel.backends.triton import gemm, launch, norm, reduce as R

    dev = "cuda"
    x = torch.randn(1152, 1024, device=dev)
    tree_y = torch.empty(1, 1024, device=dev)
    log2r, c = R._shape(1152, 1024)
    h = torch.randn(1152, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(h)
    pw = torch.empty(1152, 1024, device=dev)
    a = torch.randn(1152, 1024, device=dev, dtype=torch.bfloat16)
    wt = torch.randn(3072, 1024, device=dev, dtype=torch.bfloat16)
    variants = {
        "tree_rows": (R._tree_rows_kernel_fast, (launch.cdiv(1024, c),),
                      (x, tree_y, 1152, 1024, launch.cdiv(1024, c)), dict(C=c, R=1 << log2r, LOG2R=log2r, num_warps=4)),
        "rms_norm": (norm._rmsnorm_kernel_fast, (1152,), (h, h, w, y, h, 1024, 1024, 1024, 1024, 1024, 1e-6),
                     dict(HAS_RES=False, BLOCK=1024, num_warps=4, enable_fp_fusion=False)),
        "rms_norm_backward": (norm._rmsnorm_bwd_kernel_fast, (1152,), (h, w, h, h, y, pw, 1024, 1024, 1024, 1024, 1024, 1e-6),
                              dict(HAS_GHO=False, BLOCK=1024, num_warps=4, enable_fp_fusion=False)),
    }
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "fast_path": launch._fast_ok(), "launches": args.launches, "rounds": args.rounds, "kernels": {}}
    for name, (fk, grid, kargs, kw) in variants.items():
        fk[grid](*kargs, **kw)  # compile and fill the cache
        fk.fn[grid](*kargs, **kw)
        torch.cuda.synchronize()
        per = {"triton": [], "fast": []}
        for r in range(args.rounds):
            for path in (("triton", "fast") if r % 2 == 0 else ("fast", "triton")):
                run = fk.fn[grid] if path == "triton" else fk[grid]
                t0 = time.perf_counter()
                for _ in range(args.launches):
                    run(*kargs, **kw)
                per[path].append((time.perf_counter() - t0) / args.launches * 1e6)
                torch.cuda.synchronize()
        med = {k: round(statistics.median(v), 2) for k, v in per.items()}
        report["kernels"][name] = {"us_per_launch": med, "ratio_fast_over_triton": round(med["fast"] / med["triton"], 3)}
    # the GEMM through gemm.matmul (the wrapper's own Python included): fast path on, then off
    for path in ("fast", "triton"):
        with launch.fast_path(path == "fast"):
            gemm.matmul(a, wt)
            torch.cuda.synchronize()
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(args.launches):
                    gemm.matmul(a, wt)
                times.append((time.perf_counter() - t0) / args.launches * 1e6)
                torch.cuda.synchronize()
        report["kernels"].setdefault("gemm.matmul", {"us_per_call": {}})["us_per_call"][path] = round(statistics.median(times), 2)
    g = report["kernels"]["gemm.matmul"]["us_per_call"]
    report["kernels"]["gemm.matmul"]["ratio_fast_over_triton"] = round(g["fast"] / g["triton"], 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_launch_bench.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
