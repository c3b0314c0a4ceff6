#!/usr/bin/env python3
"""The strict path on model shapes other than the two it is timed at: does every kernel launch, and do both engines
still agree bit for bit?

The H200 runs have covered the Qwen3-0.6B and 8B shapes; a user's own model has other widths, head counts and head
dims, and a kernel config that fits one shape can fail to launch at another (session 15: a 2-layer toy Qwen3 of hidden
64 stopped in its row-parallel GEMM with "out of resource: shared memory"). For each shape below (random weights,
bf16): `vime parity --scorer megatron --update-weights` (the strict vLLM engine vs the Megatron trainer's scoring,
prefill chunks and decode batches up to 512 tokens, before and after a weight update) and two strict GRPO updates at
~150 and ~2,000 packed tokens (the row-parallel schedules' M classes), their losses finite and a re-score of the first
batch run to run equal. One JSON line per shape and `shape_smoke.json` in --out: ok, or the error's last lines.
Without CUDA it exits at once unless `--device cpu` (a smoke run of the harness itself).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> make_tiny_checkpoint keywords (2 layers each: the kernels see the real widths; depth changes no launch)
SHAPES = {
    "toy": dict(arch="qwen3", vocab_size=211, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16),
    "smollm2_135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                         head_dim=64),
    "qwen3_1p7b": dict(arch="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_heads=16, num_kv_heads=8,
                       head_dim=128),
    "llama_1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8,
                     head_dim=64),
}


def _tail(text: str, n: int = 12) -> list[str]:
    return [line[:300] for line in text.strip().splitlines()[-n:]]


def _parity(ckpt: str, device: str) -> dict:
    cmd = [sys.executable, "-m", "vime.cli", "parity", "--model", ckpt, "--scorer", "megatron", "--dtype", "bfloat16",
           "--update-weights", "--check-weights", "--num-prompts", "64", "--max-tokens", "24", "--max-num-seqs", "64",
           "--max-num-batched-tokens", "512", "--device", device]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = {"seconds": round(time.perf_counter() - t0, 1), "rc": proc.returncode}
    if proc.returncode:
        return out | {"ok": False, "error": _tail(proc.stderr)}
    rep = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    phases = rep.get("phases", {})
    ok = bool(phases) and all(p["mismatch_count"] == 0 and p["compared_tokens"] > 0 for p in phases.values())
    return out | {"ok": ok, "compared_tokens": rep.get("compared_tokens"), "mismatch_count": rep.get("mismatch_count"),
                  "max_abs_diff": rep.get("max_abs_diff"),
                  "phases": {k: {x: v.get(x) for x in ("mismatch_count", "compared_tokens", "max_abs_diff", "weights")}
                             for k, v in phases.items()}}


def _updates(ckpt: str, vocab: int, device: str) -> dict:
    import torch

    from vime.batch import TrainBatch
    from vime.grpo import GRPOConfig
    from vime.trainer import MegatronTrainer, TrainerConfig

    def batch(step: int, n: int, prompt: int, response: int) -> TrainBatch:
        g = torch.Generator().manual_seed(100 + step)
        seqs = [torch.randint(4, vocab, (prompt + response,), generator=g).tolist() for _ in range(n)]
        return TrainBatch(sequences=seqs, prompt_lens=[prompt] * n, loss_mask=[torch.ones(response) for _ in range(n)],
                          temperature=1.0, weight_version=step, advantages=torch.randn(n, generator=g))

    t0 = time.perf_counter()
    try:
        with MegatronTrainer(TrainerConfig(device=device, dtype="bfloat16", mode="strict", lr=2e-5, seed=7, grpo=GRPOConfig())) as tr:
            tr.load_hf(ckpt)
            small, large = batch(0, 16, 6, 3), batch(1, 128, 11, 5)  # 144 and 2,048 packed tokens
            before = tr.score(small)
            losses = [tr.update(small)["loss"], tr.update(large)["loss"]]
            after, again = tr.score(small), tr.score(small)
            return {"ok": all(math.isfinite(x) for x in losses) and all(torch.equal(a, b) for a, b in zip(after, again)),
                    "losses": losses, "rescore_equal": all(torch.equal(a, b) for a, b in zip(after, again)),
                    "weights_moved": not all(torch.equal(a, b) for a, b in zip(before, after)),
                    "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - a shape that fails is the finding; the next shape still runs
        import traceback

        return {"ok": False, "error": _tail(traceback.format_exc()), "seconds": round(time.perf_counter() - t0, 1)}


def _updates_in_child(ckpt: str, vocab: int, device: str) -> dict:
    """`_updates` in a process of its own: the trainer's GPU memory (allocator cache, Megatron's state) goes with it, so
    the next shape's vLLM engine finds the GPU free (session 16: 11 GB left behind refused Llama-1B's engine start)."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import gpu_shape_smoke as s; "
            f"print(json.dumps(s._updates({ckpt!r}, {vocab}, {device!r})))")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        return {"ok": False, "rc": proc.returncode, "error": _tail(proc.stderr), "seconds": round(time.perf_counter() - t0, 1)}
    return json.loads(lines[-1])


def make_shape_checkpoint(name: str, directory: Path) -> str:
    """The smoke's checkpoint of shape `name` (2 layers, random bf16 weights, seed 5) in directory/name."""
    from vime.tiny_model import make_tiny_checkpoint

    kw = SHAPES[name]
    return str(make_tiny_checkpoint(Path(directory) / name, num_layers=2, seed=5, init_std=0.02, dtype="bfloat16",
                                    tie_word_embeddings=kw["arch"] == "qwen3", **kw))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for shape_smoke.json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--checks", default="parity,updates", help="parity and/or updates")
    ap.add_argument("--checkpoints-to", metavar="DIR", help="only write the shapes' checkpoints to DIR/NAME (for `vime "
                    "diagnose --model` on the smoke's models) and exit")
    args = ap.parse_args()
    import torch

    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    if args.checkpoints_to:
        print(json.dumps({name: make_shape_checkpoint(name, Path(args.checkpoints_to)) for name in args.shapes.split(",")}))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (use --device cpu for a smoke run of the harness)"}))
        return 0
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "shapes": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in args.shapes.split(","):
            kw = SHAPES[name]
            ckpt = make_shape_checkpoint(name, Path(d))
            row = {"dims": kw}
            if "parity" in args.checks:
                row["parity"] = _parity(ckpt, args.device)
            if "updates" in args.checks:
                row["updates"] = _updates_in_child(ckpt, kw["vocab_size"], args.device)
            row["ok"] = all(row[c]["ok"] for c in ("parity", "updates") if c in row)
            report["shapes"][name] = row
            print(json.dumps({name: {k: v for k, v in row.items() if k != "dims"}}), flush=True)
    report["all_ok"] = all(r["ok"] for r in report["shapes"].values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shape_smoke.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"all_ok": report["all_ok"], "shapes": {k: v["ok"] for k, v in report["shapes"].items()}}))
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
