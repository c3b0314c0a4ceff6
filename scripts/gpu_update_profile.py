#!/usr/bin/env python3
"""Where a GRPO update's time goes at the loop's size, strict vs native, in one process.

The loop on one H200 (`grpo_qwen3_gpu`: a Qwen3-0.6B-shaped policy, 128 samples of a few tokens each) measured the
strict update at 0.82 s against native's 0.25-0.31 s, while a 4-layer Qwen3-8B-dimension train step at 8,192 tokens
costs 1.32x: at the loop's size the strict update looks launch-bound. This script times `MegatronTrainer.update` for
both modes on the same model and batches (warm-up first, then the median of timed updates), then profiles one update
of each with torch.profiler: wall time, device-kernel time and count, kernel-launch calls on the host, and the top ops
by host and by device time; then counts one more update's tensor ops by the line of this repository that issued them
(`op_sites`), where it reads device values back to the host (`readbacks`: each such read makes the host wait for
the device), and where its host time goes by Python function (`host_functions`, cProfile). JSON to --out
(`h200_update_profile.json`). On a machine without CUDA it exits at once unless `--device cpu` (a smoke run at tiny
size: what CI runs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                 head_dim=128)
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _batch(step: int, n: int, prompt: int, response: int, vocab: int):
    import torch

    from vime.batch import TrainBatch

    g = torch.Generator().manual_seed(1000 + step)
    seqs = [torch.randint(4, vocab, (prompt + response,), generator=g).tolist() for _ in range(n)]
    return TrainBatch(sequences=seqs, prompt_lens=[prompt] * n, loss_mask=[torch.ones(response) for _ in range(n)],
                      temperature=1.0, weight_version=step, advantages=torch.randn(n, generator=g))


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


_VIEWS = {"view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "permute", "unsqueeze", "squeeze", "detach",
          "alias", "select", "slice", "reshape", "_reshape_alias", "unbind", "split", "split_with_sizes", "chunk",
          "movedim", "empty", "empty_like", "empty_strided", "lift_fresh", "sym_size", "is_same_size", "_local_scalar_dense"}


def _op_sites(tr, batch, top: int) -> dict:
    """Which lines of this repository issue the update's tensor ops (views and allocations left out: they launch no
    kernel), by a TorchDispatchMode over one update: torch.profiler's stacks stay empty for autograd's backward nodes,
    and a launch-bound update is fixed where its ops come from. Each op is counted at its two innermost frames in
    rlkernel/ or vime/ (outside both, e.g. inside Megatron: the innermost frames of this repository that led there)."""
    import collections
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    root, counts, total = str(ROOT) + "/", collections.Counter(), [0]

    class Sites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _VIEWS:
                total[0] += 1
                frames = [f for f in traceback.extract_stack(limit=48)
                          if f.filename.startswith(root) and "/scripts/" not in f.filename and "/.venv/" not in f.filename
                          and not f.filename.endswith("reference/primitives.py")]
                counts[" < ".join(f"{f.filename[len(root):]}:{f.lineno}" for f in frames[-2:][::-1]) or "(outside)"] += 1
            return func(*args, **(kwargs or {}))

    with Sites():
        tr.update(batch)
    return {"ops": total[0], "top": [{"site": k, "ops": v} for k, v in counts.most_common(top)]}


# ops that read a device value back to the host (the host waits for the device's queue to drain there: on a launch-bound
# update every one serialises host and device time)
_READBACKS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique2", "allclose"}


def _sync_sites(tr, batch, top: int) -> dict:
    """Where one update reads device values back to the host, by the line of this repository (or the innermost
    Megatron / torch frame when none of ours is on the stack): a TorchDispatchMode over the ops that must wait for the
    device (`.item()`, `int(t)`, `bool(t)`, `torch.equal`, `nonzero`, boolean indexing), plus every copy to the CPU. On
    CUDA, one more update under torch's sync debug mode counts every call that made the host wait, blocking host-to-device
    copies included (`cuda_syncs`, `cuda_sync_sites`)."""
    import collections
    import traceback
    import warnings

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    root, counts, total = str(ROOT) + "/", collections.Counter(), [0]

    def site(stack) -> str:
        ours = [f for f in stack if f.filename.startswith(root) and "/scripts/" not in f.filename and "/.venv/" not in f.filename]
        if ours:
            return " < ".join(f"{f.filename[len(root):]}:{f.lineno}" for f in ours[-2:][::-1])
        inner = [f for f in stack if "/torch/utils/_python_dispatch" not in f.filename and "gpu_update_profile" not in f.filename]
        return f"{'/'.join(inner[-1].filename.split('/')[-3:])}:{inner[-1].lineno}" if inner else "(outside)"

    class Readbacks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            to_cpu = name in ("_to_copy", "copy_") and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) and (
                str((kwargs or {}).get("device", "")) == "cpu" or (name == "copy_" and not args[0].is_cuda))
            if name in _READBACKS or to_cpu:
                total[0] += 1
                counts[f"{name} @ {site(traceback.extract_stack(limit=64))}"] += 1
            return func(*args, **(kwargs or {}))

    report = {}
    with Readbacks():
        tr.update(batch)
    report.update(readbacks=total[0], top=[{"site": k, "count": v} for k, v in counts.most_common(top)])
    if torch.cuda.is_available() and next(tr.model.parameters()).is_cuda:
        # torch's sync debug mode warns at every call that makes the host wait for the device (the reads above, and
        # blocking host-to-device copies: torch.tensor(..., device="cuda"), .to("cuda") of a host tensor); each warning
        # is counted at the line of this repository on the stack when it fires
        seen = collections.Counter()

        def hook(message, category, filename, lineno, file=None, line=None):
            seen[site(traceback.extract_stack(limit=64)[:-1])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tr.update(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        report["cuda_syncs"] = sum(seen.values())
        report["cuda_sync_sites"] = [{"site": k, "count": v} for k, v in seen.most_common(top)]
    return report


def _host_functions(tr, batch, top: int) -> dict:
    """Where one update's host time goes by Python function (cProfile): the top functions by own time and by cumulative
    time, each named `area/file:line(function)`, and own time summed by area (this repository's rlkernel/ and vime/,
    triton, megatron, torch, other). torch.profiler charges a custom autograd function's Python, Triton's launcher and
    the ops it issues to one row (`_RmsNormFnBackward`: 29 ms self CPU in session 16); this splits them. cProfile's own
    overhead inflates every call alike, so compare the strict and native columns, not the absolute milliseconds."""
    import cProfile
    import pstats

    root = str(ROOT) + "/"

    def area(path: str) -> str:
        for name in ("triton", "megatron", "torch"):  # installed packages first (a .venv may sit inside the checkout)
            if f"/site-packages/{name}/" in path or f"/dist-packages/{name}/" in path:
                return name
        if path.startswith(root) and "-packages/" not in path:
            return path[len(root):].split("/")[0]
        return "other"  # builtins (C functions: torch ops, launches) and every other package

    def name(key) -> str:
        path, line, fn = key
        if "-packages/" in path:
            short = path.split("-packages/", 1)[1]
        else:
            short = path[len(root):] if path.startswith(root) else "/".join(path.split("/")[-2:])
        return f"{short}:{line}({fn})"

    device = next(tr.model.parameters()).device.type
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    tr.update(batch)
    _sync(device)
    prof.disable()
    stats = pstats.Stats(prof).stats  # key -> (primitive calls, calls, own time, cumulative time, callers)
    areas: dict[str, float] = {}
    for key, (_, calls, tt, _, _) in stats.items():
        areas[area(key[0])] = areas.get(area(key[0]), 0.0) + tt

    def rows(index: int) -> list[dict]:
        keys = sorted(stats, key=lambda k: stats[k][index], reverse=True)[:top]
        return [{"function": name(k), "calls": stats[k][1], "own_ms": round(stats[k][2] * 1e3, 3),
                 "cum_ms": round(stats[k][3] * 1e3, 3)} for k in keys]

    return {"total_own_ms": round(sum(areas.values()) * 1e3, 3),
            "own_ms_by_area": {k: round(v * 1e3, 3) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
            "top_by_own": rows(2), "top_by_cumulative": rows(3)}


def _poison_check(ckpt, args) -> dict:
    """The trainer turns torch's NaN fill of fresh allocations off (TrainerConfig.fill_uninitialized_memory): one strict
    update with the fill on (every fresh allocation poisoned) against one with it off, every parameter bit for bit."""
    import torch

    from vime.grpo import GRPOConfig
    from vime.trainer import MegatronTrainer, TrainerConfig

    shape = TINY if args.tiny else QWEN3_06B
    params = {}
    for fill in (True, False):
        cfg = TrainerConfig(device=args.device, dtype=args.dtype, mode="strict", lr=2e-5, seed=7, grpo=GRPOConfig(),
                            fill_uninitialized_memory=fill)
        with MegatronTrainer(cfg) as tr:
            tr.load_hf(ckpt)
            metrics = tr.update(_batch(1, args.sequences, args.prompt, args.response, shape["vocab_size"]))
            params[fill] = (metrics["loss"], metrics["grad_norm"], {k: v.detach().clone() for k, v in tr.model.named_parameters()})
    (la, ga, a), (lb, gb, b) = params[True], params[False]
    differ = sorted(k for k in a if not torch.equal(a[k], b[k]))
    return {"loss_equal": la == lb, "grad_norm_equal": ga == gb, "tensors": len(a), "tensors_differ": len(differ),
            "first_differing": differ[:5]}


def run(args) -> dict:
    import torch

    from vime.grpo import GRPOConfig
    from vime.profiling import profiled
    from vime.tiny_model import make_tiny_checkpoint
    from vime.trainer import MegatronTrainer, TrainerConfig

    shape = TINY if args.tiny else QWEN3_06B
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": shape, "sequences": args.sequences, "prompt_tokens": args.prompt, "response_tokens": args.response,
              "dtype": args.dtype, "modes": {}}
    try:
        from vime.stamp import code_stamp

        report["code"] = code_stamp()
    except Exception as e:  # noqa: BLE001 - a checkout without git still profiles
        report["code"] = {"error": repr(e)}
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_tiny_checkpoint(d, tie_word_embeddings=True, seed=3, init_std=0.02, dtype=args.dtype, **shape)
        for mode in args.modes.split(","):
            cfg = TrainerConfig(device=args.device, dtype=args.dtype, mode=mode, lr=2e-5, seed=7, grpo=GRPOConfig())
            with MegatronTrainer(cfg) as tr:
                tr.load_hf(ckpt)
                step, warm = 0, []
                for _ in range(args.warmup):  # the first compiles rlkernel's Triton kernels on a cold machine
                    step += 1
                    t0 = time.perf_counter()
                    m = tr.update(_batch(step, args.sequences, args.prompt, args.response, shape["vocab_size"]))
                    warm.append({"seconds": round(time.perf_counter() - t0, 3), "time_compile": m.get("time_compile")})
                times = []
                for _ in range(args.repeat):
                    step += 1
                    b = _batch(step, args.sequences, args.prompt, args.response, shape["vocab_size"])
                    _sync(args.device)
                    t0 = time.perf_counter()
                    tr.update(b)
                    _sync(args.device)
                    times.append(time.perf_counter() - t0)
                step += 1
                b = _batch(step, args.sequences, args.prompt, args.response, shape["vocab_size"])
                prof = profiled(lambda: tr.update(b), args.device, args.top)[1]
                step += 1
                prof["op_sites"] = _op_sites(tr, _batch(step, args.sequences, args.prompt, args.response, shape["vocab_size"]), args.top)
                step += 1
                prof["readbacks"] = _sync_sites(tr, _batch(step, args.sequences, args.prompt, args.response, shape["vocab_size"]), args.top)
                step += 1
                prof["host_functions"] = _host_functions(tr, _batch(step, args.sequences, args.prompt, args.response,
                                                                    shape["vocab_size"]), args.top)
                report["modes"][mode] = {"update_seconds": [round(t, 4) for t in times], "median_seconds": round(statistics.median(times), 4),
                                         "warmup": warm, "profile": prof}
            print(f"{mode}: median update {report['modes'][mode]['median_seconds']} s, {prof['device_kernels']} device kernels, "
                  f"{prof['launch_calls']} launch calls", flush=True)
        if "strict" in args.modes.split(",") and not args.skip_poison:
            report["poisoned_equal"] = _poison_check(ckpt, args)
            print(f"poisoned update == default update: {report['poisoned_equal']}", flush=True)
    m = report["modes"]
    if "strict" in m and "native" in m:
        report["ratio_strict_over_native"] = round(m["strict"]["median_seconds"] / m["native"]["median_seconds"], 3)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for h200_update_profile.json (cpu_update_profile.json with --device cpu)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model instead of the Qwen3-0.6B shape")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--modes", default="strict,native")
    ap.add_argument("--sequences", type=int, default=128, help="samples per update (grpo_qwen3_gpu: 16 prompts x 8)")
    ap.add_argument("--prompt", type=int, default=6, help="prompt tokens per sample")
    ap.add_argument("--response", type=int, default=3, help="response tokens per sample (the loop's median is about 2.6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--skip-poison", action="store_true", help="leave out the poisoned-update check (two more trainer builds)")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (use --device cpu for a smoke run)"}))
        return 0
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("h200_update_profile.json" if args.device == "cuda" else "cpu_update_profile.json")
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "modes"} | {"medians": {k: v["median_seconds"] for k, v in report["modes"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
