#!/usr/bin/env python3
"""Tensor parallelism on two GPUs: strict collectives, TP=1 vs TP=2 scoring, rollout (TP=1) vs training (TP=2).

    torchrun --standalone --nproc_per_node=2 scripts/gpu_tp_parity.py [--layers 2] [--seqs 512] [--out DIR]
    torchrun --standalone --nproc_per_node=2 scripts/gpu_tp_parity.py --device cpu --tiny   # the smoke run (gloo)

Two processes, one GPU each (NCCL; leave NVLink multicast off), random weights at Qwen3-8B
dimensions (no hub here), the Megatron-core trainer of this repo (vime.trainer.MegatronTrainer,
rlkernel's layer spec, Triton kernels under the GPU contracts):

  head         the lm_head split over the ranks: rk.vocab_parallel_logprob / _entropy == the one-device ops
  collectives  rk.tree_all_reduce of canonical segments: identical bits on both ranks and equal to the
               one-process canonical tree; latency vs a plain all_reduce at decode and prefill sizes
  scoring      MegatronTrainer.score at TP=1 (each rank alone) and TP=2 (one group): bitwise equal;
               the native path (cuBLAS + NCCL all-reduce) as the negative control
  grads        (diagnosis, not in the default list) per-parameter gradient sums of squares, TP=1 vs TP=2 (with and
               without Megatron DDP on the GPU)
  cp           (not in the default list) context parallelism on the GPUs: scores at CP=2 vs CP=1 bitwise (native as the
               negative control) and one GRPO update at CP=2 (finite, both ranks agree)
  update       two GRPO updates at TP=1 and at TP=2: the same losses, grad norms and exported weights (the
               TP-invariant backward); native as the negative control
  rollout      rank 0 decodes every sequence like a rollout engine (StrictDecoder, paged KV cache,
               requests joining and leaving, TP=1; --rollout-tp = the world: every rank holds a shard of a TP engine);
               the trainer (--train-tp x --train-cp, default TP=2) re-scores them packed:
               mismatch_count over every generated token (the claim: 0 over >= 1,000,000 tokens)

Rank 0 writes DIR/h200x2_tp_parity.json (DIR: $OUT, else benchmarks/).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
T0 = time.time()
TINY = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=1100,
            rope_theta=10000.0, rms_norm_eps=1e-6)


def log(rank, *a):
    if rank == 0:
        print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def _sync(dev):
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def collectives(args, res, rank, world, dev):
    import torch
    import torch.distributed as dist

    import rlkernel as rk

    out = {}
    S = 4 * world
    sizes = {"decode": (64, 4096), "prefill": (8192, 4096)} if not args.tiny else {"decode": (4, 64), "prefill": (64, 64)}
    for name, shape in sizes.items():
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator(device="cpu").manual_seed(5)
            segs = [torch.randn(shape, generator=g).to(dtype).to(dev) for _ in range(S)]
            k = S // world
            local = segs[rank * k:(rank + 1) * k]
            got = rk.tree_all_reduce(local, None)
            want = rk.canonical_tree_sum(segs)
            hashes = [None] * world
            dist.all_gather_object(hashes, rk.backends.reference.primitives.tree_sum(got.float().reshape(-1)[:1024], dim=0).item())
            row = {"equal_to_canonical": bool(torch.equal(got, want)), "ranks_identical": len(set(hashes)) == 1}
            # latency: strict tree (gather + tree) vs a plain all_reduce of the local sum
            plain = torch.stack(local).sum(0)

            def strict_call():
                return rk.tree_all_reduce(local, None)

            def native_call():
                x = plain.clone()
                dist.all_reduce(x)
                return x

            for fn in (strict_call, native_call):
                fn()
            times = {}
            for label, fn in (("strict", strict_call), ("native", native_call)):
                ts = []
                for _ in range(args.reps):
                    _sync(dev)
                    t = time.perf_counter()
                    fn()
                    _sync(dev)
                    ts.append(time.perf_counter() - t)
                times[label] = statistics.median(ts)
            row.update(strict_us=round(times["strict"] * 1e6, 1), native_us=round(times["native"] * 1e6, 1),
                       ratio_strict_over_native=round(times["strict"] / times["native"], 3))
            out[f"{name}/{str(dtype).split('.')[-1]}/{list(shape)}"] = row
            log(rank, "collective", name, dtype, row)
    res["collectives"] = out


def head(args, res, rank, world, dev):
    """The lm_head alone at the model's vocab, split over the ranks as the trainer splits it (whole VOCAB_TILEs per
    rank): rk.vocab_parallel_logprob / _entropy equal the one-device rk.linear_logprob / _entropy on every rank, in
    bf16 and fp32; the native control (float32 logits + log_softmax, cuBLAS) is compared with the same reference."""
    import torch

    import rlkernel as rk

    dims = TINY if args.tiny else {"hidden_size": 4096, "vocab_size": 151936}
    H, V, T = dims["hidden_size"], dims["vocab_size"], 64 if args.tiny else 4096
    tiles = -(-V // rk.VOCAB_TILE)
    shard = -(-tiles // world) * rk.VOCAB_TILE
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator(device="cpu").manual_seed(9)
        h = (torch.randn(T, H, generator=g) * 2).to(dtype).to(dev)
        w = (torch.randn(shard * world, H, generator=g) * 0.02).to(dtype).to(dev)
        tg = torch.randint(0, V, (T,), generator=g).to(dev)
        want = rk.linear_logprob(h, w, tg, 0.9, vocab_size=V)
        want_ent = rk.linear_entropy(h, w, 0.9, vocab_size=V)
        mine = w[rank * shard:(rank + 1) * shard]
        got = rk.vocab_parallel_logprob(h, mine, tg, vocab_start=rank * shard, vocab_size=V, temperature=0.9)
        got_ent = rk.vocab_parallel_entropy(h, mine, vocab_start=rank * shard, vocab_size=V, temperature=0.9)
        native = torch.log_softmax(torch.nn.functional.linear(h, w[:V]).float() / 0.9, -1).gather(1, tg[:, None])[:, 0]
        row = {"logprob_equal": bool(torch.equal(got, want)), "entropy_equal": bool(torch.equal(got_ent, want_ent)),
               "native_mismatch": int((native != want).sum()), "tokens": T,
               "max_abs_diff_logprob": float((got - want).abs().max()), "max_abs_diff_entropy": float((got_ent - want_ent).abs().max())}
        flags = [None] * world
        torch.distributed.all_gather_object(flags, (row["logprob_equal"], row["entropy_equal"]))
        row["every_rank_equal"] = all(a and b for a, b in flags)
        out[str(dtype).split(".")[-1]] = row
        log(rank, "head", dtype, row)
    res["head"] = out


def write_checkpoint(args, dev, path: Path):
    """A random Qwen3-shaped HF checkpoint (config.json + model.safetensors), from the same weights the rollout uses."""
    import torch
    from safetensors.torch import save_file

    import gpu_strict_parity as gsp

    gsp.DEV = dev
    if args.tiny:
        gsp.QWEN3_8B = TINY
    model = gsp.build_model(args.layers, seed=0)
    dims = gsp.QWEN3_8B
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": args.layers, "hidden_size": dims["hidden_size"],
           "intermediate_size": dims["intermediate_size"], "num_attention_heads": dims["num_heads"],
           "num_key_value_heads": dims["num_kv_heads"], "head_dim": dims["head_dim"], "vocab_size": dims["vocab_size"],
           "rope_theta": dims["rope_theta"], "rms_norm_eps": dims["rms_norm_eps"], "tie_word_embeddings": False,
           "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return model


def tp_decoder(ckpt: Path, dev, rank: int, world: int):
    """The rollout engine's model at TP=world (rlkernel's StrictDecoder sharded as vLLM's strict model is: heads and MLP
    rows split, o/down merged by the canonical segment tree), this rank's shard loaded from the checkpoint."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    import gpu_strict_parity as gsp
    from rlkernel.models.decoder import DecoderConfig, StrictDecoder, TensorParallel

    cfg = DecoderConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    model = StrictDecoder(cfg, dtype=torch.bfloat16, device=dev, tp=TensorParallel(rank=rank, world=world, group=dist.group.WORLD))
    model.load_hf_weights(load_file(str(ckpt / "model.safetensors"), device=str(dev)))
    model.requires_grad_(False)
    model.set_max_positions(8192)
    gsp.DEV = dev
    return model


def _update_batch(seqs, plens):
    """All sequences in one packed batch, with advantages spread over [-1, 1]: what the update checks train on."""
    import dataclasses

    import torch

    _, batch = next(_batches(seqs, plens, 1 << 30))
    return dataclasses.replace(batch, advantages=torch.linspace(-1.0, 1.0, len(batch.sequences)))


def _batches(seqs, plens, pack_tokens):
    import torch

    from vime.batch import TrainBatch

    i = 0
    while i < len(seqs):
        j, n = i, 0
        while j < len(seqs) and (j == i or n + len(seqs[j]) <= pack_tokens):
            n += len(seqs[j])
            j += 1
        yield i, TrainBatch(sequences=seqs[i:j], prompt_lens=plens[i:j], loss_mask=[torch.ones(len(s) - p) for s, p in zip(seqs[i:j], plens[i:j])],
                            temperature=1.0, weight_version=0)
        i = j


def _probe(model, store: dict, rows: int = 256):
    """Forward hooks that keep the first `rows` output rows of every decoder layer and of the final norm, from the
    first batch only: where TP=1 and TP=2 part ways when their logprobs differ."""
    model = getattr(model, "module", model)
    sites = [(f"layer{i}", layer) for i, layer in enumerate(model.gpt.decoder.layers)] + [("final_norm", model.final_layernorm)]

    def hook(name):
        def fn(_mod, _inp, out):
            if name not in store:
                t = out[0] if isinstance(out, tuple) else out
                store[name] = t.reshape(-1, t.shape[-1])[:rows].detach().float().cpu()
        return fn

    return [m.register_forward_hook(hook(n)) for n, m in sites]


def _free(dev):
    """Collect finished trainers (reference cycles keep their models on the GPU) and return the cached blocks: one call
    running the grads and update parts ran out of GPU memory without it (2026-12-01)."""
    import gc

    import torch

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def trainer_updates(ckpt, tp, mode, dev, seqs, plens):
    """Two GRPO updates on one packed batch at this TP size: (metrics, exported HF weights, scores after)."""
    from vime.trainer import MegatronTrainer, TrainerConfig

    batch = _update_batch(seqs, plens)
    with MegatronTrainer(TrainerConfig(tp=tp, mode=mode, dtype="bfloat16", device=dev, lr=1e-4)) as trainer:
        trainer.load_hf(ckpt)
        metrics = [trainer.update(batch) for _ in range(2)]
        weights = trainer.export_weights(trainer.weight_version)
        after = [lp.cpu() for lp in trainer.score(batch)]
    return metrics, weights, after


def grad_stats(ckpt, tp, mode, dev, seqs, plens, ddp: bool = True) -> dict:
    """Per parameter, the sum of squares of its gradient just before the optimizer step (the DDP main_grad on the
    GPU, .grad on the CPU), over the whole parameter (TP shards summed; replicated ones from TP rank 0): where TP=1
    and TP=2 training part ways."""
    import torch
    import torch.distributed as dist

    from vime.trainer import MegatronTrainer, TrainerConfig

    batch = _update_batch(seqs, plens)
    stats = {}
    ddp = ddp and dev == "cuda"
    with MegatronTrainer(TrainerConfig(tp=tp, mode=mode, dtype="bfloat16", device=dev, lr=1e-4, megatron_ddp=ddp)) as trainer:
        trainer.load_hf(ckpt)
        step_name = "_cuda_step" if ddp else "_cpu_step"
        real = getattr(trainer, step_name)

        def recording_step():
            if ddp:
                from megatron.core.distributed import finalize_model_grads
                finalize_model_grads([trainer._ddp])
            for name, p in trainer.model.named_parameters():
                g = getattr(p, "main_grad", None) if ddp else p.grad
                if g is not None:
                    stats[name] = (float(g.double().square().sum()), bool(getattr(p, "tensor_model_parallel", False)))
            if ddp:  # finalize ran above; the optimizer alone now
                _, norm, _ = trainer.optimizer.step()
                return float(norm or 0.0)
            return real()

        setattr(trainer, step_name, recording_step)
        metrics = trainer.update(batch)
        group = trainer.tp_group
    every = [None] * tp
    if tp > 1:
        dist.all_gather_object(every, stats, group=group)
    else:
        every = [stats]
    total = {}
    for name, (sq, sharded) in every[0].items():
        total[name] = sum(e[name][0] for e in every) if sharded else sq
    return {"grad_sq": total, "grad_norm": metrics["grad_norm"]}


def _update_report(a, b) -> dict:
    import torch

    (ma, wa, sa), (mb, wb, sb) = a, b
    keys = ("loss", "grad_norm")
    return {"metrics_equal": all(x[k] == y[k] for x, y in zip(ma, mb) for k in keys),
            "losses": [[x["loss"], y["loss"]] for x, y in zip(ma, mb)],
            "grad_norms": [[x["grad_norm"], y["grad_norm"]] for x, y in zip(ma, mb)],
            "weights_equal": sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa),
            "weights_differing": sum(not torch.equal(wa[k], wb[k]) for k in wa if k in wb),
            "scores_after_equal": all(torch.equal(x, y) for x, y in zip(sa, sb))}


def trainer_scores(ckpt, tp, mode, dev, seqs, plens, pack_tokens, probe: dict | None = None, cp: int = 1):
    import torch

    from vime.trainer import MegatronTrainer, TrainerConfig

    with MegatronTrainer(TrainerConfig(tp=tp, cp=cp, mode=mode, dtype="bfloat16", device=dev)) as trainer:
        trainer.load_hf(ckpt)
        if probe is not None:
            _probe(trainer.model, probe)
        out = {}
        for first, batch in _batches(seqs, plens, pack_tokens):
            for k, lp in enumerate(trainer.score(batch)):
                out[first + k] = lp.to(torch.float32)
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--gen-min", type=int, default=1024)
    ap.add_argument("--gen-max", type=int, default=3072)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--pack-tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions (the CPU smoke run)")
    ap.add_argument("--only", default="collectives,head,scoring,update,rollout")
    ap.add_argument("--score-tp", type=int, default=2, help="scoring part: the TP size compared with TP=1 (4 on four GPUs)")
    ap.add_argument("--rollout-tp", type=int, default=1, help="rollout part: the decoding engine's TP (1: rank 0 alone, or the world)")
    ap.add_argument("--train-tp", type=int, default=2, help="rollout part: the re-scoring trainer's TP (x --train-cp = world)")
    ap.add_argument("--train-cp", type=int, default=1, help="rollout part: the re-scoring trainer's CP")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks"))
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise SystemExit("run under torchrun --nproc_per_node=2")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # one default process group for the whole run: each trainer below builds (and tears down) only Megatron's groups on it
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    only = set(args.only.split(","))
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "world": world, "torch": torch.__version__,
           "layers": args.layers, "dims": "tiny" if args.tiny else "qwen3-8b"}
    from vime.stamp import code_stamp

    res["code"] = code_stamp()  # which sources measured it (scripts/stale_results.py)
    if "collectives" in only:
        collectives(args, res, rank, world, dev)
    if "head" in only:
        head(args, res, rank, world, dev)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "0")
    ckpt = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / f"vime_tp_parity_{run_id}" / "ckpt"
    import gpu_strict_parity as gsp

    model = None
    if rank == 0:
        model = write_checkpoint(args, dev, ckpt)
        (ckpt / "ready").write_text("1")
    else:
        gsp.DEV = dev
        if args.tiny:
            gsp.QWEN3_8B = TINY
    vocab = gsp.QWEN3_8B["vocab_size"]
    gen = (4, 24) if args.tiny else (args.gen_min, args.gen_max)
    seqs, plens = gsp.make_seqs(args.seqs, vocab, (4, 32) if args.tiny else (16, 256), gen, seed=7)
    while not (ckpt / "ready").exists():  # rank 0 writes the checkpoint both trainers load
        time.sleep(0.5)
    if "scoring" in only:
        sub = max(8, args.seqs // 16)
        p1, p2 = {}, {}
        s1 = trainer_scores(str(ckpt), 1, "strict", dev, seqs[:sub], plens[:sub], args.pack_tokens, p1)
        n = args.score_tp
        s2 = trainer_scores(str(ckpt), n, "strict", dev, seqs[:sub], plens[:sub], args.pack_tokens, p2)
        n1 = trainer_scores(str(ckpt), 1, "native", dev, seqs[:sub], plens[:sub], args.pack_tokens)
        n2 = trainer_scores(str(ckpt), n, "native", dev, seqs[:sub], plens[:sub], args.pack_tokens)
        res["scoring"] = {f"strict_tp1_vs_tp{n}": gsp.compare(s1, s2), f"native_tp1_vs_tp{n}": gsp.compare(n1, n2),
                          # the first batch's first rows at every layer's output: equal bits, or where they part
                          "strict_sites_equal": {k: bool(torch.equal(p1[k], p2[k])) for k in p1}}
        log(rank, "scoring", res["scoring"])
    if "cp" in only:  # context parallelism: the packed stream split over the two GPUs (pieces through the paged kernel)
        sub = max(8, args.seqs // 16)
        t = time.time()
        c1 = trainer_scores(str(ckpt), 1, "strict", dev, seqs[:sub], plens[:sub], args.pack_tokens)
        c2 = trainer_scores(str(ckpt), 1, "strict", dev, seqs[:sub], plens[:sub], args.pack_tokens, cp=2)
        n1 = trainer_scores(str(ckpt), 1, "native", dev, seqs[:sub], plens[:sub], args.pack_tokens)
        n2 = trainer_scores(str(ckpt), 1, "native", dev, seqs[:sub], plens[:sub], args.pack_tokens, cp=2)
        res["cp"] = {"strict_cp1_vs_cp2": gsp.compare(c1, c2), "native_cp1_vs_cp2": gsp.compare(n1, n2),
                     "seconds": round(time.time() - t, 1)}
        log(rank, "cp_scores", res["cp"])  # before the update, so a failing update keeps the scoring comparison
        from vime.trainer import MegatronTrainer, TrainerConfig

        batch = _update_batch(seqs[:8], plens[:8])  # an update at CP=2 runs, and both ranks agree on it
        with MegatronTrainer(TrainerConfig(tp=1, cp=2, mode="strict", dtype="bfloat16", device=dev, lr=1e-4)) as trainer:
            trainer.load_hf(str(ckpt))
            m = trainer.update(batch)
        every = [None] * world
        dist.all_gather_object(every, (m["loss"], m["grad_norm"]))
        res["cp"]["update_cp2"] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "ranks_agree": all(e == every[0] for e in every)}
        log(rank, "cp", res["cp"])
        _free(dev)
        # the token-segmented backward (trainer token_segments=2): two updates at CP=2 against CP=1 (each rank a
        # data-parallel replica of the same batch there: the mean of two equal gradients is exact), every weight
        # tensor compared bit for bit; and the same without token segments as the control
        res["cp"]["token_segments"] = {}
        for s in (2, 1):
            runs, t = {}, time.time()
            for cp in (1, 2):
                with MegatronTrainer(TrainerConfig(tp=1, cp=cp, mode="strict", dtype="bfloat16", device=dev, lr=1e-4,
                                                   token_segments=s)) as trainer:
                    trainer.load_hf(str(ckpt))
                    ms = [trainer.update(batch), trainer.update(batch)]
                    runs[cp] = ([(x["loss"], x["grad_norm"]) for x in ms], {k: v.cpu() for k, v in trainer.export_weights(2).items()})
                _free(dev)
            differ = [k for k in runs[1][1] if not torch.equal(runs[1][1][k], runs[2][1][k])]
            res["cp"]["token_segments"][f"S={s}"] = {"losses_grad_norms_equal": runs[1][0] == runs[2][0], "tensors": len(runs[1][1]),
                                                     "tensors_differ": len(differ), "first_differ": differ[:3],
                                                     "seconds": round(time.time() - t, 1)}
            log(rank, "cp token segments", s, res["cp"]["token_segments"][f"S={s}"])
    if "grads" in only:  # per-parameter gradient sums of squares at TP=1 vs TP=2, strict (diagnosis)
        # TP=1 under Megatron DDP is the reference (its grad norms equal the CPU's); TP=2 with and without DDP (the
        # explicit step) separates DDP from the autograd graph
        one = grad_stats(str(ckpt), 1, "strict", dev, seqs[:8], plens[:8])
        res["grads"] = {}
        for label, ddp in (("ddp" if dev == "cuda" else "cpu_step", True), ("explicit_step", False)):  # no DDP on the CPU
            if label == "explicit_step" and dev != "cuda":
                continue
            two = grad_stats(str(ckpt), 2, "strict", dev, seqs[:8], plens[:8], ddp=ddp)
            diff = {k: [one["grad_sq"][k], two["grad_sq"].get(k)] for k in one["grad_sq"]
                    if two["grad_sq"].get(k) is None or abs(one["grad_sq"][k] - two["grad_sq"][k]) > 1e-6 * max(one["grad_sq"][k], 1e-30)}
            res["grads"][f"tp1_vs_tp2_{label}"] = {"grad_norm": [one["grad_norm"], two["grad_norm"]], "params": len(one["grad_sq"]),
                                                   "differing": diff, "sum_sq": [sum(one["grad_sq"].values()), sum(two["grad_sq"].values())]}
        log(rank, "grads", res["grads"])
        _free(dev)
    if "update" in only:  # the backward: two updates at TP=1 and TP=2 give the same metrics and weights
        _free(dev)  # the grads part's trainers (their recording steps hold them in a cycle) out of GPU memory first
        sub = 4 if args.tiny else 8
        t = time.time()
        rep = {}
        for mode in ("strict", "native"):
            one = trainer_updates(str(ckpt), 1, mode, dev, seqs[:sub], plens[:sub])
            two = trainer_updates(str(ckpt), 2, mode, dev, seqs[:sub], plens[:sub])
            rep[f"{mode}_tp1_vs_tp2"] = _update_report(one, two)
            _free(dev)
        rep["tokens"], rep["seconds"] = sum(len(x) for x in seqs[:sub]), round(time.time() - t, 1)
        res["update"] = rep
        log(rank, "update", rep)
    if "rollout" in only:
        ro = None
        rtp, ttp, tcp = args.rollout_tp, args.train_tp, args.train_cp
        if rtp not in (1, world) or ttp * tcp != world:
            raise SystemExit(f"--rollout-tp must be 1 or the world size {world}, and --train-tp x --train-cp the world size")
        if rank == 0 or rtp > 1:  # TP=1: rank 0 decodes alone; TP=world: every rank holds its shard of the engine
            model = model if rtp == 1 else tp_decoder(ckpt, dev, rank, rtp)
            max_len = max(len(s) for s in seqs)
            conc = min(args.concurrency, len(seqs))
            cache = gsp.PagedCache(args.layers, conc * ((max_len + 15) // 16 + 1) + 64, 16, gsp.QWEN3_8B["num_kv_heads"] // rtp,
                                   gsp.QWEN3_8B["head_dim"], seed=3)
            t = time.time()
            with torch.no_grad():
                ro, steps = gsp.rollout(model, seqs, plens, conc, cache, seed=11)
            _sync(dev)
            res["rollout_setup"] = {"sequences": len(seqs), "engine_steps": steps, "seconds": round(time.time() - t, 1),
                                    "concurrency": conc, "page_size": 16, "rollout_tp": rtp}
            log(rank, "rollout", res["rollout_setup"])
            del cache
        t = time.time()
        tr = trainer_scores(str(ckpt), ttp, "strict", dev, seqs, plens, args.pack_tokens, cp=tcp)
        if rank == 0:
            key = "rollout_tp1_vs_training_tp2" if (rtp, ttp, tcp) == (1, 2, 1) else f"rollout_tp{rtp}_vs_training_tp{ttp}_cp{tcp}"
            res[key] = gsp.compare({s: ro[s].float().cpu() for s in ro}, {s: tr[s].cpu() for s in tr})
            res[key]["training_seconds"] = round(time.time() - t, 1)
            log(rank, "rollout vs training", res[key])
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"h200x{world}_tp_parity.json" if dev == "cuda" and not args.tiny else "tp_parity_smoke.json"
        (out / name).write_text(json.dumps(res, indent=1))
        print(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
