"""Benchmark the strict CPU GEMM (rlkernel/backends/cpu/csrc/gemm.cpp) against torch F.linear.

Every output of ours is one float32 FMA chain over K ascending (bits independent of ISA,
threads and batch size); F.linear is MKL (fp32) / oneDNN (bf16, AMX on CPUs that have it).
Both run in this process, side by side, at torch's default thread count.

Columns:
  torch    F.linear(x, w) time (x, w in the dtype; bf16 output for bf16)
  packed   rlkernel::matmul_packed(x, pack_b(w.t()), N)  (weights packed once; bf16 stays bf16)
  packf32  bf16 only: matmul_packed on a float32 packing of the bf16 weights (pack_b(w.t().float()))
  plain    rlkernel::matmul(x, w.t())  (packs per call)
  ratio_*  torch time / our time (>= 1: we are faster)

Usage: .venv/bin/python scripts/bench_gemm.py [--quick] [--dtypes fp32,bf16] [--m 1,4,16] [--shapes smol,qwen,misc]
                                              [--threads N] [--clock wall|thread]
Writes (merges) benchmarks/cpu_gemm.json under runs["<clock>_<threads>threads"].
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "rlkernel" / "backends" / "cpu" / "csrc" / "gemm.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
# standalone build: its own op namespace, so it never collides with the project library
OPS_NS = "rlkernel_gemm_standalone"
NS_FLAG = f"-DRK_GEMM_OPS_NAMESPACE={OPS_NS}"

SHAPES = {  # name -> (N, K): y[M, N] = x[M, K] W[N, K]^T
    "smol": [("smol.q", 576, 576), ("smol.kv", 192, 576), ("smol.o", 576, 576), ("smol.gate_up", 3072, 576),
             ("smol.down", 576, 1536), ("smol.lm_head", 49152, 576)],
    "qwen": [("qwen.qkv", 4096, 1024), ("qwen.o", 1024, 2048), ("qwen.gate_up", 6144, 1024), ("qwen.down", 1024, 3072),
             ("qwen.lm_head", 151936, 1024)],
    "misc": [("k1000n300", 300, 1000), ("k4096n4096", 4096, 4096)],
}
MS = [1, 4, 16, 64, 256, 1024, 2048]


def load_library(march: str = "native", build_root: Path | None = None) -> Path:
    """Build (once, cached by source+flags+torch) and load the GEMM op library; returns the .so path."""
    flags = FLAGS[:1] + [f"-march={march}"] + FLAGS[2:] + [NS_FLAG]  # (-fopenmp: at::parallel_for really runs threads)
    h = hashlib.sha256()
    for part in (SRC.read_bytes(), (SRC.parent / "gemm.h").read_bytes(), " ".join(flags).encode(), torch.__version__.encode()):
        h.update(part)
    if march == "native":
        try:
            h.update(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).encode())
        except (OSError, StopIteration):
            pass
    key = h.hexdigest()[:16]
    root = build_root or Path(os.environ.get("RLKERNEL_BUILD_DIR") or Path.home() / ".cache" / "rlkernel")
    d = root / f"gemm_bench_{key}"
    name = f"rlkernel_gemm_{key}"
    lib = d / f"{name}.so"
    if not lib.exists():
        from torch.utils import cpp_extension

        bindir = str(Path(sys.executable).parent)  # ninja lives in the venv's bin/
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        d.mkdir(parents=True, exist_ok=True)
        t = time.time()
        cpp_extension.load(name=name, sources=[str(SRC)], build_directory=str(d), extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           is_python_module=False)
        print(f"built {lib} in {time.time() - t:.1f}s", file=sys.stderr)
    else:
        torch.ops.load_library(str(lib))
    return lib


CLOCK = time.perf_counter


def timeit(fns, budget: float, min_reps: int = 3, max_reps: int = 200) -> list[tuple[float, float]]:
    """Interleaved repetitions of each fn (robust to load from other processes): (best, median) seconds each."""
    est = 0.0
    for fn in fns:
        fn()
        t0 = time.perf_counter()
        fn()
        est += max(time.perf_counter() - t0, 1e-7)
    reps = int(min(max_reps, max(min_reps, budget * len(fns) / est)))
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = CLOCK()
            fn()
            ts[i].append(CLOCK() - t)
    return [(min(t), statistics.median(t)) for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller time budget; skip M >= 1024 for lm_head shapes")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="smol,qwen,misc")
    ap.add_argument("--filter", default="", help="only shapes whose name contains this")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="wall: perf_counter; thread: the calling thread's CPU time (needs --threads 1; immune to "
                         "other processes taking the core, which a loaded 2-core machine makes necessary)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu_gemm.json"))
    args = ap.parse_args()

    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread":
        assert torch.get_num_threads() == 1, "--clock thread measures the calling thread only: use --threads 1"
        CLOCK = time.thread_time
    t = time.time()
    lib = load_library()
    build_s = time.time() - t
    ops = getattr(torch.ops, OPS_NS)
    print(f"library {lib} ({build_s:.1f}s to build/load), isa={ops.matmul_isa()}, threads={torch.get_num_threads()}")
    budget = 0.1 if args.quick else 0.3
    ms = [int(x) for x in args.m.split(",")]
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    hdr = f"{'shape':>16} {'dtype':>5} {'M':>5} {'torch_us':>10} {'packed_us':>10} {'r_packed':>8} {'packf32_us':>10} {'r_pf32':>7} {'plain_us':>10} {'r_plain':>7}"
    load0 = os.getloadavg()
    print(f"loadavg at start: {load0}")
    warning = None
    if args.clock == "wall" and load0[0] > 0.5 * (os.cpu_count() or 1):
        warning = (f"machine busy (loadavg {load0[0]:.1f} on {os.cpu_count()} CPUs): multi-threaded wall-clock times, "
                   "MKL's especially, are unreliable; compare with --threads 1 --clock thread")
        print("WARNING: " + warning)
    print(hdr)
    for group in args.shapes.split(","):
        for name, N, K in SHAPES[group]:
            if args.filter and args.filter not in name:
                continue
            for dname in args.dtypes.split(","):
                dt = dts[dname]
                g = torch.Generator().manual_seed(0)
                w = (torch.randn(N, K, generator=g) / K**0.5).to(dt)
                packed = ops.pack_b(w.t())
                packed32 = ops.pack_b(w.t().float()) if dt == torch.bfloat16 else None
                for M in ms:
                    if args.quick and "lm_head" in name and M >= 1024:
                        continue
                    x = torch.randn(M, K, generator=g).to(dt)
                    big = M * N * K > 2e10
                    b = budget * (0.5 if big else 1.0)
                    fns = [lambda: F.linear(x, w), lambda: ops.matmul_packed(x, packed, N), lambda: ops.matmul(x, w.t())]
                    if packed32 is not None:
                        fns.append(lambda: ops.matmul_packed(x, packed32, N))
                    res = timeit(fns, b)
                    (tt, tt_med), (tp, tp_med), (tu, tu_med) = res[:3]
                    tf = res[3][0] if packed32 is not None else None
                    r = dict(shape=name, N=N, K=K, M=M, dtype=dname, torch_us=tt * 1e6, packed_us=tp * 1e6,
                             ratio_packed=tt / tp, plain_us=tu * 1e6, ratio_plain=tt / tu,
                             torch_median_us=tt_med * 1e6, packed_median_us=tp_med * 1e6, plain_median_us=tu_med * 1e6,
                             gflops_torch=2 * M * N * K / tt / 1e9, gflops_packed=2 * M * N * K / tp / 1e9)
                    if tf is not None:
                        r.update(packf32_us=tf * 1e6, ratio_packf32=tt / tf)
                    rows.append(r)
                    pf = f"{r['packf32_us']:10.1f} {r['ratio_packf32']:7.2f}" if tf is not None else f"{'-':>10} {'-':>7}"
                    print(f"{name:>16} {dname:>5} {M:>5} {tt*1e6:10.1f} {tp*1e6:10.1f} {tt/tp:8.2f} {pf} {tu*1e6:10.1f} {tt/tu:7.2f}",
                          flush=True)
                    del x
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(loadavg_at_end=os.getloadavg(), build_or_load_s=build_s, isa=ops.matmul_isa(), threads=torch.get_num_threads(), torch=torch.__version__, cpu=platform.processor(),
                flags=FLAGS, timing="best of interleaved repetitions (medians stored too)", date=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        meta["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    run = f"{args.clock}_{torch.get_num_threads()}threads"
    meta["clock"] = args.clock
    meta["loadavg_at_start"] = load0
    if warning:
        meta["warning"] = warning
    doc = {}
    if out.exists():
        try:
            doc = json.loads(out.read_text())
        except ValueError:
            doc = {}
    doc.setdefault("runs", {})[run] = dict(meta=meta, rows=rows)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
