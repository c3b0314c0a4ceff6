"""`vime parity`: generate with vLLM, re-score with a training-side scorer, compare bitwise.

What this module decides: the parity experiment users run before trusting a
setup. Prompts are random token sequences (half of them share a long prefix,
so the prefix cache is hit); each has its own response length; the engine's
scheduler limits force chunked prefill mixed with decode. The scorer runs a
full-sequence packed forward of the same weights (`reference`: rlkernel's
standalone scorer; `megatron`: the Megatron-core engine) at the same
temperature. With `--update-weights` the weights are perturbed, pushed to the
engine as version 1, and the comparison is repeated. The last stdout line is
one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

import torch


def _prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, vocab) for _ in range(hi)]
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        if i % 2:  # shares a prefix with every other odd prompt: prefix-cache hits
            cut = max(1, length - rng.randint(1, max(1, length // 4)))
            out.append(shared[:cut] + [rng.randrange(4, vocab) for _ in range(length - cut)])
        else:
            out.append([rng.randrange(4, vocab) for _ in range(length)])
    return out


class _ReferenceScorer:
    """rlkernel's standalone packed scorer (StrictDecoder)."""

    def __init__(self, model_dir: str, dtype: torch.dtype, mode: str, device: str, ops: dict, row_segments: int):
        from rlkernel.models import StrictDecoder

        self.model = StrictDecoder.from_pretrained(model_dir, dtype=dtype, device=device, row_segments=row_segments)
        self.mode, self.ops = mode, ops

    def response_logprobs(self, comps, temperature):
        import rlkernel as rk

        with torch.no_grad(), rk.mode(self.mode, ops=self.ops):
            full = self.model.score([c.prompt_ids + c.response_ids for c in comps], temperature)
        return [lp[len(c.prompt_ids) - 1:].cpu() for lp, c in zip(full, comps)]

    def weights(self) -> dict:
        return dict(self.model.state_dict())

    def load(self, tensors: dict, version: int) -> None:
        self.model.load_hf_weights(tensors)


class _MegatronScorer:
    """The Megatron-core training engine's `score`."""

    def __init__(self, model_dir: str, dtype: torch.dtype, mode: str, device: str, ops: dict, row_segments: int):
        from .trainer import MegatronTrainer, TrainerConfig

        self.trainer = MegatronTrainer(TrainerConfig(mode=mode, dtype=str(dtype).removeprefix("torch."), device=device,
                                                     ops=tuple(sorted(ops.items())), row_segments=row_segments))
        self.trainer.load_hf(model_dir)

    def response_logprobs(self, comps, temperature):
        from .batch import TrainBatch

        batch = TrainBatch(sequences=[c.prompt_ids + c.response_ids for c in comps], prompt_lens=[len(c.prompt_ids) for c in comps],
                           loss_mask=[torch.ones(len(c.response_ids)) for c in comps], temperature=temperature,
                           weight_version=self.trainer.weight_version)
        return self.trainer.score(batch)

    def weights(self) -> dict:
        return self.trainer.export_weights(self.trainer.weight_version)

    def load(self, tensors: dict, version: int) -> None:
        self.trainer.load_weights(tensors, version)


def _perturb(tensors: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.05 * v.float().std().clamp_min(1e-3) * torch.randn(v.shape, generator=g).to(v.device)).to(v.dtype)
            for k, v in tensors.items()}


def _weights_check(engine, scorer, sent: dict | None) -> dict:
    """Whether both sides hold exactly the weights of this phase (bit patterns, by rlkernel.golden.digest): the
    engine's against `sent` (the pushed tensors; at v0 the scorer's own, both loaded from the checkpoint) and the
    scorer's against `sent`. A mismatch after an update then says which side holds other weights, or that both
    hold the same and the kernels differ. The engine side needs the strict engine at TP=1 (else "not compared")."""
    from rlkernel.golden import digest

    own = {k: digest([v]) for k, v in scorer.weights().items()}
    want = own if sent is None else {k: digest([v]) for k, v in sent.items()}

    def compare(got: dict | None) -> dict:
        if got is None:
            return {"compared": 0, "note": "not compared (stock engine or TP > 1)"}
        names = sorted(set(got) & set(want))
        differ = [n for n in names if got[n] != want[n]]
        absent = sorted(set(want) - set(got) - {"lm_head.weight"})  # a tied head is the embedding
        return {"compared": len(names), "differ": differ[:20], "differ_count": len(differ), "absent": absent[:20]}

    return {"engine": compare(engine.weight_digests()), "scorer": compare(own)}


def _restart_phase(args, engine, sent: dict, scorer, prompts, specs, updated) -> dict:
    """A fresh engine started from a checkpoint of the version-1 weights (`sent`) generates the same prompts with the
    same seed: its logprobs against the scorer's (a mismatch here and not in v1: the kernels, not the update), and
    whether it sampled the updated engine's tokens with the updated engine's logprobs (both equal: the in-place update
    is exact; v1 differing while this does not: the update is what differs)."""
    import tempfile

    from .metrics import compare_logprobs
    from .rollout import VLLMRollout

    with tempfile.TemporaryDirectory(prefix="vime_parity_restart_") as d:
        fresh = VLLMRollout(dataclasses.replace(engine.config, model=str(engine.write_checkpoint(sent, d))))
        t1 = time.perf_counter()
        comps = fresh.generate(prompts, specs, weight_version=0)
        t2 = time.perf_counter()
    train = scorer.response_logprobs(comps, args.temperature)
    stats = compare_logprobs([c.logprobs for c in comps], train)
    same_tokens = [a.response_ids == b.response_ids for a, b in zip(comps, updated)]
    same_lp = [s and torch.equal(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs))
               for s, a, b in zip(same_tokens, comps, updated)]
    stats.update(generate_seconds=round(t2 - t1, 3), generated_tokens=sum(len(c.response_ids) for c in comps),
                 sequences=len(comps), same_tokens_as_updated=sum(same_tokens), same_logprobs_as_updated=sum(same_lp))
    return stats


def run(args) -> dict:
    from rlkernel.models import DecoderConfig

    from .metrics import compare_logprobs
    from .records import SamplingSpec
    from .rollout import TP_GRAPHS_ENV, RolloutConfig, VLLMRollout, graphs_proved, tp_graphs_experiment

    if args.row_segments is None:  # auto, as `vime train` resolves it: the engine's TP size (the scorer runs at TP=1)
        from .config import ConfigError, auto_row_segments
        try:
            args.row_segments = auto_row_segments(**{"--tp": args.tp})
        except ConfigError as e:
            raise SystemExit(f"vime parity: {e}") from None
    rs = args.row_segments
    if not (1 <= rs <= 64 and not rs & (rs - 1)) or rs % args.tp:
        raise SystemExit(f"vime parity: --row-segments must be a power of two from 1 to 64 that --tp={args.tp} divides, got {rs}")
    if args.cuda_graphs == "on" and not torch.cuda.is_available():
        raise SystemExit("vime parity: --cuda-graphs needs a CUDA GPU (vLLM on the CPU runs eager)")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    kind = args.engine or ("rlkernel" if args.mode == "strict" else "stock")
    ops = {"attention": "fa3"} if args.attention == "fa3" else {}
    if ops and (args.mode != "strict" or kind != "rlkernel"):
        raise SystemExit("vime parity: --attention fa3 is the strict path's (--mode strict with the rlkernel engine)")
    if ops and (not torch.cuda.is_available() or args.dtype != "bfloat16"):
        raise SystemExit("vime parity: --attention fa3 needs a CUDA GPU and --dtype bfloat16 (FA3 has no CPU or float32 kernel)")
    # auto: what `vime train` runs (roles.default_enforce_eager): graphs on a GPU where they are proved
    graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and torch.cuda.is_available() and graphs_proved(kind, args.tp))
    if graphs and not graphs_proved(kind, args.tp):
        raise SystemExit("vime parity: the strict engine's CUDA graphs are proved at TP=1 only; use --cuda-graphs off with --tp > 1 "
                         f"(or {TP_GRAPHS_ENV}=1: the experiment that would prove them)")
    # stock vLLM-CPU's attention needs blocks of a multiple of 32; the strict backend and stock vLLM on a GPU take 16
    block = args.block_size or (32 if kind == "stock" and not torch.cuda.is_available() else 16)
    if args.save_updated and not args.update_weights:
        raise SystemExit("vime parity: --save-updated writes the updated weights: it needs --update-weights")
    if args.restart_check and not args.update_weights:
        raise SystemExit("vime parity: --restart-check compares the updated engine with a fresh one: it needs --update-weights")
    engine = VLLMRollout(RolloutConfig(
        model=args.model, engine=kind, mode=args.mode, dtype=args.dtype, temperature=args.temperature, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=block, seed=args.seed, tp=args.tp,
        max_model_len=args.max_prompt_len + args.max_tokens + 8, enable_prefix_caching=True, enforce_eager=not graphs,
        ops=tuple(sorted(ops.items())), row_segments=args.row_segments,
        # --restart-check starts a second engine beside the first: each takes under half of the GPU
        gpu_memory_utilization=0.4 if args.restart_check else None,
    ))
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    scorer = (_ReferenceScorer if args.scorer == "reference" else _MegatronScorer)(args.model, dtype, args.mode, device, ops, args.row_segments)
    from pathlib import Path

    vocab = DecoderConfig.from_hf(json.loads(Path(args.model, "config.json").read_text())).vocab_size
    rng = random.Random(args.seed)
    prompts = _prompts(vocab, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed)
    # --restart-check: every request seeded, so a fresh engine samples what the updated one did when its logprobs agree
    specs = [SamplingSpec(temperature=args.temperature, max_tokens=rng.randint(max(1, args.max_tokens // 4), args.max_tokens),
                          seed=args.seed * 100_003 + i if args.restart_check else None) for i in range(len(prompts))]
    phases = {}
    versions = [0] + ([1] if args.update_weights else [])
    for version in versions:
        if version:
            new = _perturb(scorer.weights(), args.seed + version)
            if args.save_updated:  # the version-1 weights as a checkpoint: a later `--model` run starts from them
                engine.write_checkpoint(new, args.save_updated)
            engine.update_weights(new, version)
            scorer.load(new, version)
        weights = _weights_check(engine, scorer, new if version else None) if args.check_weights else None
        t1 = time.perf_counter()
        comps = engine.generate(prompts, specs, weight_version=version)
        t2 = time.perf_counter()
        train = scorer.response_logprobs(comps, args.temperature)
        stats = compare_logprobs([c.logprobs for c in comps], train)
        stats.update(weight_version=version, generate_seconds=round(t2 - t1, 3), score_seconds=round(time.perf_counter() - t2, 3),
                     generated_tokens=sum(len(c.response_ids) for c in comps), prefix_cached_tokens=sum(c.cached_prompt_tokens for c in comps),
                     versions_ok=all(c.weight_version == version for c in comps))
        if weights is not None:
            stats["weights"] = weights
        phases[f"v{version}"] = stats
    if args.restart_check:
        phases["v1_restart"] = _restart_phase(args, engine, new, scorer, prompts, specs, comps)
    last = phases[f"v{versions[-1]}"]
    worker = engine.provenance.engine_args.get("worker", {})  # the strict engine's rlkernel_info ({} for stock vLLM)
    report = dict(mode=args.mode, attention=args.attention, engine=engine.config.engine, cuda_graphs=not engine.config.enforce_eager, scorer=args.scorer, scorer_device=device, engine_tp=args.tp, row_segments=args.row_segments, engine_row_segments=worker.get("row_segments"), engine_workers=worker.get("workers"), engine_runner=worker.get("runner"), engine_logprobs_mode=worker.get("logprobs_mode"), engine_contract_sampler=worker.get("contract_sampler"), engine_tp_ranks=worker.get("tp_ranks"), engine_tp_gathers=worker.get("tp_gathers"), strict_tp_graphs_experiment=tp_graphs_experiment(), model=args.model, num_prompts=args.num_prompts, dtype=args.dtype,
                  temperature=args.temperature, engine_start_seconds=round(engine.provenance.start_seconds, 2),
                  total_seconds=round(time.perf_counter() - t0, 2), phases=phases,
                  mismatch_count=sum(p["mismatch_count"] for p in phases.values()),
                  max_abs_diff=max(p["max_abs_diff"] for p in phases.values()),
                  mean_abs_diff=last["mean_abs_diff"], compared_tokens=sum(p["compared_tokens"] for p in phases.values()))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--mode", choices=["strict", "native"], default="strict", help="rlkernel mode of both sides")
    p.add_argument("--engine", choices=["rlkernel", "stock"], default=None,
                   help="vLLM with the rlkernel plugin, or stock vLLM (default: rlkernel for strict, stock for native)")
    p.add_argument("--scorer", choices=["reference", "megatron"], default="reference")
    p.add_argument("--attention", choices=["strict", "fa3"], default="strict",
                   help="fa3: both sides' attention by FlashAttention 3 (vLLM's build, one KV split; GPU, bf16; checked at load)")
    p.add_argument("--tp", type=int, default=1, help="the engine's tensor parallelism (the scorer stays at TP=1)")
    p.add_argument("--row-segments", type=int, default=None,
                   help="canonical K segments of the row-parallel layers, both sides (rlkernel.row_segments; the TP size must "
                        "divide it). Default: auto, as vime train resolves it (--tp: one segment a rank, plain GEMMs)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="the scorer's device (auto: cuda where there is one, as vLLM does); both sides must share a contract family")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--min-prompt-len", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=None,
                   help="KV-cache block size (default: 32 for stock vLLM on the CPU, which needs a multiple of 32; else 16)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="the engine's CUDA graphs (stock: compiled + graphs; strict: decode-only graphs). auto (default): as "
                        "`vime train` runs it — on a GPU, except the strict engine at --tp > 1; eager on the CPU. "
                        "A bare --cuda-graphs means on")
    p.add_argument("--update-weights", action="store_true", help="also perturb the weights, push them as version 1, compare again")
    p.add_argument("--save-updated", metavar="DIR", help="with --update-weights: also write the version-1 weights to DIR as an "
                   "HF checkpoint (config and tokenizer beside them), so `--model DIR` starts both sides from them")
    p.add_argument("--restart-check", action="store_true",
                   help="with --update-weights: also start a fresh engine from a checkpoint of the version-1 weights and "
                        "compare it with the scorer and with the updated engine (phases.v1_restart); each engine then "
                        "takes 0.4 of the GPU")
    p.add_argument("--check-weights", action="store_true",
                   help="per phase, check bit for bit that the engine (strict, TP=1) and the scorer hold the weights sent "
                        "(phases.vN.weights: which side differs, if any)")


def main(args) -> int:
    report = run(args)
    sys.stdout.flush()
    print(json.dumps(report))
    return 0
