#!/usr/bin/env python3
"""Why a GEMM's chained time differs from its device time (session 49, an H100): at gate_up M = 256 the strict GEMM's
kernel ran 89.8 us alone (torch.profiler, one call at a time) against cuBLAS's 88.7, yet 98.0 against 84.6 us a call
in the harness's chain (a CUDA graph of 8 calls on 8 weights, back to back). Per GEMM and timer:
- `chain_us`: the harness's chain (scripts/gpu_gemm_sweep.chain_ms);
- `spaced_us`: the same chain with a gap kernel of `--gap-us` before each call, less the gaps' own chain
  (`sleep_chain_us`, the gap as it ran): the call without its neighbour's tail or launch overlapping it (what the
  profiler's one-at-a-time reading sees); `spaced_clock_mhz` / `spaced_power_w` sampled during it. The gap kernel
  spins on %globaltimer (wall time). Sessions 49-50 used torch.cuda._sleep, which counts SM clocks: calibrated
  alone, at the idle card's clock, it ran longer beside a GEMM that holds the clock down at the power cap, so their
  `spaced_us` at gate_up M = 256 (power-bound) are not the call's time;
- `same_weight_us`: the chain on one weight (L2 keeps none of 50-200 MB; a control for the 8 weights);
- `clock_mhz` / `power_w`: the SM clock and board power sampled (NVML, through torch.cuda) during ~1.5 s of calls
  (eager, 64 at a time on the 8 weights).

    python3 scripts/gpu_chain_gap.py --out DIR      # a CUDA machine; writes DIR/chain_gap.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def sampled(fn, seconds: float) -> dict:
    """fn() repeated for ~seconds while another thread samples the SM clock and the board power: medians."""
    import torch

    clocks, power, stop = [], [], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                clocks.append(torch.cuda.clock_rate())
                power.append(torch.cuda.power_draw() / 1000)
            except Exception:  # noqa: BLE001 -- no NVML here: no samples
                return
            time.sleep(0.01)

    th = threading.Thread(target=sample)
    th.start()
    t0 = time.time()
    while time.time() - t0 < seconds:
        fn()
        torch.cuda.synchronize()
    stop.set()
    th.join()
    med = statistics.median
    return {"clock_mhz": med(clocks) if clocks else None, "power_w": round(med(power), 1) if power else None,
            "samples": len(clocks)}


def wall_sleep():
    """A one-warp Triton kernel that spins until `ns` nanoseconds of %globaltimer have passed: a gap of wall time,
    whatever the SM clock (torch.cuda._sleep counts clocks). Built here so that the script imports without Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _wall_sleep(ns):
        t0 = _now()
        t = t0
        while t - t0 < ns:
            t = _now()

    return _wall_sleep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    ap.add_argument("--cases", default="qkv:256,gate_up:256", help="GEMM:M,...")
    ap.add_argument("--tiles", default="", help="extra Gluon tiles (scripts/gpu_gluon_gemm.TILES) timed beside")
    ap.add_argument("--gap-us", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from gpu_gluon_gemm import gpu_header, run

    res: dict = {"rows": []}
    if gpu_header(res):  # the device, or "skipped" without CUDA
        import torch

        from gpu_gemm_sweep import chain_ms
        from gpu_strict_parity import GEMMS
        from rlkernel.backends.triton import gemm

        res["timer"] = ("us per call; chain_us: a CUDA graph of 8 calls on 8 weights (gpu_gemm_sweep.chain_ms); "
                        "spaced_us / same_weight_us: the docstring's variants")
        kern, ns = wall_sleep(), int(args.gap_us * 1000)

        def gap():
            kern[(1,)](ns, num_warps=1)
        gap()  # compiled outside the graphs
        res["gap"] = {"us_asked": args.gap_us, "kernel": "spin on %globaltimer"}
        for case in args.cases.split(","):
            gname, m = case.split(":")
            K, N = GEMMS[gname]
            M = int(m)
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(8)]
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            timers = {"cublas": lambda i: torch.nn.functional.linear(a, ws[i]),
                      "library": lambda i: gemm.matmul(a, ws[i])}
            for name in filter(None, args.tiles.split(",")):
                timers[name] = lambda i, name=name: run(a, ws[i], name)
            row = {"gemm": gname, "M": M, "timers": {}}
            sleep_us = []
            for _ in range(args.rounds):
                sleep_us.append(1000 * chain_ms(lambda i: gap()))
            row["sleep_chain_us"] = round(statistics.median(sleep_us), 2)
            got = {k: {"chain": [], "spaced": [], "same_weight": []} for k in timers}
            for _ in range(args.rounds):
                for k, fn in timers.items():
                    got[k]["chain"].append(1000 * chain_ms(fn))
                    got[k]["spaced"].append(1000 * chain_ms(lambda i, fn=fn: (gap(), fn(i))[1])
                                            - row["sleep_chain_us"])
                    got[k]["same_weight"].append(1000 * chain_ms(lambda i, fn=fn: fn(0)))
            for k, fn in timers.items():
                rec = {f"{t}_us": round(statistics.median(v), 2) for t, v in got[k].items()}
                rec.update(sampled(lambda fn=fn: [fn(i % 8) for i in range(64)], 1.5))
                spaced = sampled(lambda fn=fn: [(gap(), fn(i % 8)) for i in range(64)], 1.5)
                rec.update(spaced_clock_mhz=spaced["clock_mhz"], spaced_power_w=spaced["power_w"])
                row["timers"][k] = rec
            for t in ("chain", "spaced", "same_weight"):
                row[f"library_vs_cublas_{t}"] = round(row["timers"]["cublas"][f"{t}_us"]
                                                      / row["timers"]["library"][f"{t}_us"], 3)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chain_gap.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
