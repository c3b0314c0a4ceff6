"""Training-engine throughput: `MegatronTrainer.score` and `.update` tokens/s, strict vs native.

What this script decides: the numbers quoted for the cost of the strict contract on the
training side. Both modes run in this one process on the same checkpoint and batch, one
after the other, so their ratio compares like with like (the absolute numbers depend on
the machine and on what else runs on it). Configs: `tiny` (the test model) and `50m`
(a ~50M-parameter Qwen3: vocab 50k tied, hidden 512, 8 layers). Tokens/s counts every
packed token the forward processes; each figure is the best of --repeats timed calls
after a warm-up. Ends with one JSON line.

    .venv/bin/python scripts/bench_train.py [--configs tiny,50m] [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings

import torch

CONFIGS = {
    "tiny": dict(ckpt=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
                 samples=16, length=64, prompt=16),
    "50m": dict(ckpt=dict(vocab_size=50000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64),
                samples=8, length=128, prompt=32),
}


def _batch(spec: dict, vocab: int):
    from vime.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    n, L, p = spec["samples"], spec["length"], spec["prompt"]
    seqs = [torch.randint(4, vocab, (L - (i % 4) * 3,), generator=g).tolist() for i in range(n)]  # varied lengths
    return TrainBatch(sequences=seqs, prompt_lens=[p] * n, loss_mask=[torch.ones(len(s) - p) for s in seqs], temperature=1.0,
                      weight_version=0, advantages=torch.randn(n, generator=g))


def _timed(fn, repeats: int) -> float:
    """Best of `repeats` after one warm-up: the cores are shared, the minimum is the least disturbed run."""
    fn()  # warm-up (rope tables, allocator, first-call paths)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench(name: str, repeats: int, threads: int) -> dict:
    from vime.tiny_model import make_tiny_checkpoint
    from vime.trainer import MegatronTrainer, TrainerConfig

    spec = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(tmp, arch="qwen3", tie_word_embeddings=True, seed=0, **spec["ckpt"])
        batch = _batch(spec, spec["ckpt"]["vocab_size"])
        out = {"tokens": batch.num_tokens, "threads": threads}
        for mode in ("strict", "native"):
            with MegatronTrainer(TrainerConfig(mode=mode, threads=threads, lr=1e-5)) as trainer:
                trainer.load_hf(ckpt)
                out["params"] = sum(p.numel() for p in trainer.model.parameters())
                score_s = _timed(lambda: trainer.score(batch), repeats)
                update_s = _timed(lambda: trainer.update(batch), repeats)
            out[mode] = {"score_tok_s": batch.num_tokens / score_s, "update_tok_s": batch.num_tokens / update_s}
        out["strict_over_native"] = {k: out["strict"][k] / out["native"][k] for k in ("score_tok_s", "update_tok_s")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,50m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    results = {}
    for name in args.configs.split(","):
        r = results[name] = bench(name, args.repeats, args.threads)
        print(f"{name}: {r['params'] / 1e6:.1f}M params, {r['tokens']} tokens/batch, {r['threads']} threads")
        for mode in ("strict", "native"):
            print(f"  {mode:6s}  score {r[mode]['score_tok_s']:10.0f} tok/s   update {r[mode]['update_tok_s']:10.0f} tok/s")
        q = r["strict_over_native"]
        print(f"  strict/native  score x{q['score_tok_s']:.3f}   update x{q['update_tok_s']:.3f}")
    print(json.dumps({"bench": "train", "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
