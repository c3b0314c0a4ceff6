#!/usr/bin/env python3
"""The Megatron-core engine on a CUDA device (Megatron DDP + Megatron's mixed-precision optimizer):
strict scoring equals rlkernel's standalone scorer bitwise, GRPO updates run and are
run-to-run deterministic, exported weights restore scorer parity. Prints one JSON line."""
from __future__ import annotations

import json
import sys
import tempfile

import torch

from rlkernel.models import StrictDecoder
from vime.batch import TrainBatch
from vime.grpo import GRPOConfig
from vime.tiny_model import make_tiny_checkpoint
from vime.trainer import MegatronTrainer, TrainerConfig


def _batch(step: int) -> TrainBatch:
    g = torch.Generator().manual_seed(100 + step)
    lens, prompts = (12, 40, 17, 30), (3, 10, 5, 29)
    seqs = [torch.randint(4, 200, (n,), generator=g).tolist() for n in lens]
    return TrainBatch(sequences=seqs, prompt_lens=list(prompts), loss_mask=[torch.ones(n - p) for n, p in zip(lens, prompts)],
                      temperature=0.9, weight_version=step, advantages=torch.randn(len(lens), generator=g))


def run(ckpt, dtype):
    out = {}
    with MegatronTrainer(TrainerConfig(device="cuda", dtype=dtype, lr=1e-3, seed=7, grpo=GRPOConfig(entropy_coef=0.01))) as tr:
        tr.load_hf(ckpt)
        ref = StrictDecoder.from_pretrained(ckpt, dtype=getattr(torch, dtype), device="cuda")
        b = _batch(0)
        with torch.no_grad():
            full = ref.score(b.sequences, b.temperature)
        want = [lp[p - 1:].cpu() for lp, p in zip(full, b.prompt_lens)]
        got = tr.score(b)
        out["score_equal_v0"] = all(torch.equal(x, y) for x, y in zip(got, want))
        out["metrics"] = [tr.update(_batch(s)) for s in range(1, 3)]
        w = tr.export_weights(tr.weight_version)
        ref.load_hf_weights({k: v.to("cuda") for k, v in w.items()})
        with torch.no_grad():
            full = ref.score(b.sequences, b.temperature)
        want = [lp[p - 1:].cpu() for lp, p in zip(full, b.prompt_lens)]
        out["score_equal_after_update"] = all(torch.equal(x, y) for x, y in zip(tr.score(b), want))
        out["weights"] = {k: v.cpu() for k, v in w.items()}
        out["provenance_backend"] = tr.provenance.get("backend")
    return out


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    report = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_tiny_checkpoint(d, vocab_size=200, tie_word_embeddings=False, seed=2, init_std=0.08)
        for dtype in sys.argv[1:] or ["float32"]:
            a, b = run(ckpt, dtype), run(ckpt, dtype)
            report[dtype] = {
                "score_equal_v0": a["score_equal_v0"], "score_equal_after_update": a["score_equal_after_update"],
                "run_to_run_weights_equal": all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]),
                "losses": [m["loss"] for m in a["metrics"]], "losses_equal": [m["loss"] for m in a["metrics"]] == [m["loss"] for m in b["metrics"]],
                "grad_norms": [m["grad_norm"] for m in a["metrics"]], "backend": a["provenance_backend"],
            }
    print(json.dumps({"device": torch.cuda.get_device_name(), **report}))
