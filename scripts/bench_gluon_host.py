#!/usr/bin/env python3
"""Host time of one Gluon GEMM launch (`rlkernel/backends/triton/gemm_gluon.launch`), on any machine: Triton's
driver is stubbed for sm_90 (tests/helpers.STUB_SM90_DRIVER: no GPU, the compiled kernel a stand-in whose launch does
nothing), so what is timed is the Python a launch costs — the tensor descriptors, Triton's binder, the fast path —
which a GPU run pays per GEMM on top of the kernel (host-bound at small M: session 28's do_bench rows).

    python3 scripts/bench_gluon_host.py [--launches 5000] [--rounds 7] [--out DIR]

Side by side in one process, rounds interleaved: the descriptors built by TensorDescriptor's constructor (its
__post_init__ validation) against `gluon_checks.descriptor` (the same objects, without it), for two tiles; the median
microseconds a launch and their ratio go to stdout as JSON and to DIR/gluon_host_bench.json.
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
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from helpers import STUB_SM90_DRIVER

    env: dict = {}
    exec(STUB_SM90_DRIVER.replace("        calls.append(args)", "        pass"), env)  # noqa: S102 -- our own stub
    torch, Kernel, compute_cache_key = env["torch"], env["Kernel"], env["compute_cache_key"]
    from rlkernel.backends.triton import gemm_gluon as GG, gluon_checks as GC

    if GG._IMPORT_ERROR is not None:
        print(json.dumps({"skipped": GG._IMPORT_ERROR}))
        return 0
    a, w = torch.zeros(300, 4096, dtype=torch.bfloat16), torch.zeros(6144, 4096, dtype=torch.bfloat16)
    out = torch.empty(300, 6144, dtype=torch.bfloat16)
    GG._SMS[-1] = 132
    GG._descriptor(a, 300, 4096, 64)  # fills GC._TD
    res = {"launches": args.launches, "rounds": args.rounds, "tiles": {}}
    for tile in (GG.ONE_WAVE, GG.SEG_128x128):
        grid, largs, kwargs = GG._launch_args(a, w, tile, out)
        cache, keys, _, _, binder = GG._gemm_kernel.device_caches[0]
        _, spec, options = binder(*largs, **kwargs, debug=False, instrumentation_mode="")
        cache[compute_cache_key(keys, spec, options)] = Kernel()
        GG.launch(a, w, tile, out)
        times = {"constructor": [], "descriptor": []}
        for _ in range(args.rounds):
            for name, plain in (("constructor", False), ("descriptor", True)):
                saved, GC._TD[1] = GC._TD[1], plain and GC._TD[1]
                try:
                    t0 = time.perf_counter()
                    for _ in range(args.launches):
                        GG.launch(a, w, tile, out)
                    times[name].append((time.perf_counter() - t0) / args.launches * 1e6)
                finally:
                    GC._TD[1] = saved
        med = {k: round(statistics.median(v), 2) for k, v in times.items()}
        res["tiles"][tile.name] = {"us_per_launch": med, "ratio": round(med["descriptor"] / med["constructor"], 3),
                                   "rounds_us": times}
    text = json.dumps(res)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gluon_host_bench.json").write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
