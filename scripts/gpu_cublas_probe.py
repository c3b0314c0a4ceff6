#!/usr/bin/env python3
"""Which kernel cuBLAS runs at each Qwen3-8B GEMM shape, and what each kernel costs on the device.

    python3 scripts/gpu_cublas_probe.py --out DIR          # an H200; writes DIR/h200_cublas_probe.json

Why: the strict GEMM stays short of 0.9x cuBLAS at M = 256 for qkv (N = 6,144: 96 tiles of 128 x 128 on 132 SMs) and
for the row-parallel layers' 4-segment schedules. cuBLAS's kernel names (sm90_xmma_... / nvjet_...) state its tile,
cluster shape and whether it splits K (split-K, stream-K): whether it wins inside an order like ours or by splitting K,
which our contract cannot do without changing the bits. Per shape and M: the kernel names torch.profiler saw for one
F.linear and for one strict `gemm.matmul` (and the 4-segment row-parallel GEMM for o / down), with device microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def kernels_of(fn, reps: int = 20) -> list[dict]:
    """Device kernels one call of fn launches: name, calls per fn call, mean device microseconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name].append(e.device_time)  # microseconds
    return sorted(({"kernel": k, "per_call": round(len(v) / reps, 2), "mean_us": round(sum(v) / len(v), 2)}
                   for k, v in agg.items()), key=lambda r: -r["mean_us"] * r["per_call"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--ms", default="64,256,1024,4096")
    args = ap.parse_args(argv)
    import torch

    res: dict = {"rows": []}
    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
    else:
        from gpu_strict_parity import GEMMS
        from rlkernel.backends.triton import gemm

        res["device"] = torch.cuda.get_device_name()
        res["torch"] = torch.__version__
        res["cublas"] = torch.backends.cuda.preferred_blas_library().name
        for name in ("qkv", "o", "gate_up", "down"):
            K, N = GEMMS[name]
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            for M in (int(m) for m in args.ms.split(",")):
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                row = {"gemm": name, "M": M, "K": K, "N": N,
                       "cublas": kernels_of(lambda: torch.nn.functional.linear(a, w)),
                       "strict": kernels_of(lambda: gemm.matmul(a, w))}
                if name in ("o", "down"):  # matmul's default schedule for segments ("launches"), as call 1 ran it
                    row["strict_segments4"] = kernels_of(lambda: gemm.matmul(a, w, k_segments=4))
                res["rows"].append(row)
                print(json.dumps({k: row[k] for k in ("gemm", "M")} | {"cublas": row["cublas"][:2]}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_cublas_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"rows": len(res["rows"]), "skipped": res.get("skipped")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
