"""One `_prefill3_kernel` variant in a process of its own, for a kernel that faults (session 39: `three_osm_k3` hit an
illegal memory access and the CUDA context it poisoned failed every later variant): runs the variant once on B x L
packed requests (synchronised, so a fault is reported here), compares its output and lse bit for bit with the
production kernel's, and prints one JSON line. `RLKERNEL_TRITON_FAST_LAUNCH=0` runs it through Triton's own launch.

    python3 scripts/gpu_osm_probe.py three_osm_k2 --B 2 --L 1100
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--L", type=int, default=1100, help="tokens a request (> 512: a fold at 8 chunks of 64 keys)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON line to OUT/osm_probe.jsonl")
    a = ap.parse_args(argv)
    import torch

    import gpu_gluon_attn as GA

    if a.variant not in GA.VARIANTS:
        ap.error(f"unknown variant {a.variant!r}; known: {', '.join(sorted(GA.VARIANTS))}")
    rec = {"variant": a.variant, "B": a.B, "L": a.L, "fast_launch": os.environ.get("RLKERNEL_TRITON_FAST_LAUNCH", "1"),
           "device": torch.cuda.get_device_name()}
    q, k, v, cu, _ = GA.packed_inputs(a.B, a.L)
    lse_ref = torch.empty(q.shape[:2], device="cuda", dtype=torch.float32)
    ref = GA.gluon_varlen(q, k, v, cu, a.L, "production", lse=lse_ref)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        lse = torch.full_like(lse_ref, float("nan"))
        out = GA.gluon_varlen(q, k, v, cu, a.L, a.variant, lse=lse)
        torch.cuda.synchronize()
        rec.update(ran=True, equal=bool(torch.equal(out, ref)), lse_equal=bool(torch.equal(lse, lse_ref)),
                   rows_differ=int((out != ref).any(-1).any(-1).sum()), seconds=round(time.perf_counter() - t0, 2))
    except Exception as e:  # noqa: BLE001 - the record is the point
        rec.update(ran=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    line = json.dumps(rec)
    print(line, flush=True)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        with open(a.out / "osm_probe.jsonl", "a") as f:
            f.write(line + "\n")
    return 0 if rec.get("equal") else 1


if __name__ == "__main__":
    sys.exit(main())
