"""Claims: GRPO training on Megatron-core with the strict spec is bitwise deterministic, and
its exported weights put the strict scorer back in agreement with it.

1. Two runs of 3 `update` steps (GRPO with KL to the frozen reference, k3, TIS and an entropy bonus) from the
   same checkpoint and seed give bitwise identical losses, grad norms, weights (all HF
   tensors, torch.equal) and post-update scores; a run on 1 thread equals a run on 2 threads.
   (No native counterexample for threads here: measured on this 2-core CPU, the native path
   is thread-invariant too at these and at 4x larger shapes, so none is asserted.)
2. After the updates, `export_weights(version)` loaded into a `StrictDecoder` makes
   `StrictDecoder.score` equal `MegatronTrainer.score` bitwise under the new version; the
   weights did change, and `weight_version` counts the updates.
3. Negative control: the native path's post-update scores differ from the strict decoder
   loaded with its own exported weights (mismatch > 0).
4. The engine records its determinism settings in `provenance` and restores torch's on
   close; with torch's NaN fill of fresh allocations on (poisoned) a run equals the default run (fill off); a failed start (tp=2 in a world of 1) raises and leaves no process group behind.
5. Misuse raises: exporting a version the model is not at, updating without advantages.
"""
import copy
import math

import pytest
import torch

from helpers import threads
from rlkernel.models import StrictDecoder
from vime.batch import TrainBatch
from vime.grpo import GRPOConfig
from vime.tiny_model import make_tiny_checkpoint
from vime.trainer import MegatronTrainer, NonFiniteUpdateError, TrainerConfig
from test_honest_metrics import NAN, _batch as _adv_batch  # the census's batches

STEPS = 3
GRPO = GRPOConfig(kl_coef=0.05, kl_estimator="k3", tis_cap=2.0, entropy_coef=0.01)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train"), arch="qwen3", vocab_size=200, tie_word_embeddings=False, seed=2, init_std=0.08)


def _batch(step: int) -> TrainBatch:
    g = torch.Generator().manual_seed(100 + step)
    lens, prompts = (12, 40, 17, 30), (3, 10, 5, 29)
    seqs = [torch.randint(4, 200, (n,), generator=g).tolist() for n in lens]
    masks = [torch.ones(n - p) for n, p in zip(lens, prompts)]
    masks[1][-3:] = 0
    rollout = [-torch.rand(n - p, generator=g) * 5 for n, p in zip(lens, prompts)]
    return TrainBatch(sequences=seqs, prompt_lens=list(prompts), loss_mask=masks, temperature=0.9, weight_version=step,
                      advantages=torch.randn(len(lens), generator=g), rollout_logprobs=rollout)


def _train(checkpoint, mode="strict", n_threads=None, **config) -> dict:
    with MegatronTrainer(TrainerConfig(mode=mode, lr=1e-3, seed=7, threads=n_threads, grpo=GRPO, **config)) as trainer:
        trainer.load_hf(checkpoint)
        metrics = [trainer.update(_batch(s)) for s in range(STEPS)]
        out = {
            "metrics": metrics,
            "version": trainer.weight_version,
            "weights": trainer.export_weights(trainer.weight_version),
            "scores": trainer.score(_batch(STEPS)),
            "provenance": dict(trainer.provenance),
        }
        with pytest.raises(ValueError, match="version"):
            trainer.export_weights(0)
    return out


def _equal_runs(a: dict, b: dict) -> None:
    for ma, mb in zip(a["metrics"], b["metrics"]):
        assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"] and ma["entropy"] == mb["entropy"]
        assert 0 < ma["entropy"] < 6  # nats; log(200) = 5.3 bounds a 200-token vocab
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    assert all(torch.equal(x, y) for x, y in zip(a["scores"], b["scores"]))


@pytest.fixture(scope="module")
def strict_run(checkpoint):
    with threads(2):
        return _train(checkpoint)


def test_training_is_run_to_run_deterministic(checkpoint, strict_run):
    with threads(2):
        _equal_runs(strict_run, _train(checkpoint))


def test_training_does_not_depend_on_thread_count(checkpoint, strict_run):
    one = _train(checkpoint, n_threads=1)
    assert one["provenance"]["threads"] == 1 and strict_run["provenance"]["threads"] == 2
    _equal_runs(strict_run, one)


def test_training_reads_no_uninitialized_memory(checkpoint, strict_run):
    """The trainer turns off torch's NaN fill of fresh allocations (one kernel per torch.empty on a GPU). That is only
    safe if no op reads memory it did not write: poisoned (every fresh allocation NaN, ints at their max) equals the
    default run in every loss, grad norm, weight and score."""
    poisoned = _train(checkpoint, n_threads=2, fill_uninitialized_memory=True)
    assert poisoned["provenance"]["fill_uninitialized_memory"] is True
    assert strict_run["provenance"]["fill_uninitialized_memory"] is False
    _equal_runs(strict_run, poisoned)


def _decoder_scores(checkpoint, weights, batch):
    dec = StrictDecoder.from_pretrained(checkpoint)
    before = {k: v.clone() for k, v in dec.state_dict().items()}
    dec.load_hf_weights(weights)
    with torch.no_grad():
        full = dec.score(batch.sequences, batch.temperature)
    return [lp[p - 1:] for lp, p in zip(full, batch.prompt_lens)], before


def test_exported_weights_restore_parity_after_update(checkpoint, strict_run):
    assert strict_run["version"] == STEPS and [m["weight_version"] for m in strict_run["metrics"]] == [1, 2, 3]
    want, before = _decoder_scores(checkpoint, strict_run["weights"], _batch(STEPS))
    assert not torch.equal(before["model.layers.0.mlp.down_proj.weight"], strict_run["weights"]["model.layers.0.mlp.down_proj.weight"])
    assert all(torch.equal(a, b) for a, b in zip(strict_run["scores"], want))
    m = strict_run["metrics"][-1]
    assert m["kl"] > 0 and "tis_weight_mean" in m and m["grad_norm"] > 0


def test_native_scores_mismatch_the_strict_decoder(checkpoint):
    run = _train(checkpoint, mode="native")
    want, _ = _decoder_scores(checkpoint, run["weights"], _batch(STEPS))
    assert int((torch.cat(run["scores"]) != torch.cat(want)).sum()) > 0


def test_provenance_and_restored_settings(strict_run, checkpoint):
    p = strict_run["provenance"]
    assert p["deterministic_algorithms"] is True and p["seed"] == 7 and p["mode"] == "strict" and p["backend"] == "gloo"
    assert p["contracts"]["linear"].startswith("linear/strict/")
    assert not torch.are_deterministic_algorithms_enabled()  # restored by close()
    assert torch.utils.deterministic.fill_uninitialized_memory is True  # torch's default, restored by close()
    n_threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="divisible"):
        MegatronTrainer(TrainerConfig(tp=2, threads=1))
    assert not torch.distributed.is_initialized() and torch.get_num_threads() == n_threads
    with MegatronTrainer(TrainerConfig()) as trainer:
        trainer.load_hf(checkpoint)
        b = _batch(0)
        b.advantages = None
        with pytest.raises(ValueError, match="advantages"):
            trainer.update(b)
    with pytest.raises(ValueError, match="entropy"):
        TrainerConfig(tp=2, grpo=GRPOConfig(entropy_coef=0.01))


def test_micro_batches_cut_whole_samples_in_order():
    """TrainBatch.micro_batches: consecutive runs of whole samples within the token budget (a longer sample alone), every
    per-sample field sliced alike; 0 or a budget above the batch: the batch itself; a negative budget raises."""
    b = _batch(0)  # samples of 12, 40, 17 and 30 tokens
    assert b.micro_batches(0) == [b] and b.micro_batches(99) == [b]
    parts = b.micro_batches(50)
    assert [len(p.sequences) for p in parts] == [1, 1, 2] and [p.num_tokens for p in parts] == [12, 40, 47]
    assert [len(p.sequences) for p in b.micro_batches(20)] == [1, 1, 1, 1]  # 40 and 30 exceed it: each alone
    assert sum((p.sequences for p in parts), []) == b.sequences
    assert torch.equal(torch.cat([p.advantages for p in parts]), b.advantages)
    assert all(torch.equal(x, y) for x, y in zip([m for p in parts for m in p.loss_mask], b.loss_mask))
    assert all(torch.equal(x, y) for x, y in zip([m for p in parts for m in p.rollout_logprobs], b.rollout_logprobs))
    with pytest.raises(ValueError, match=">= 0"):
        b.micro_batches(-1)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainerConfig(micro_batch_tokens=-5)


def test_strict_scores_do_not_depend_on_the_micro_batches(checkpoint):
    """Scoring in micro-batches (trainer micro_batch_tokens) gives the whole batch's logprobs bit for bit on the strict
    path (batch invariance). The native path's difference, if any, is printed (a record: this CPU's BLAS may agree)."""
    batch = _batch(STEPS)
    scores = {}
    for mode in ("strict", "native"):
        for budget in (0, 50):
            with MegatronTrainer(TrainerConfig(mode=mode, seed=7, threads=2, micro_batch_tokens=budget)) as trainer:
                trainer.load_hf(checkpoint)
                scores[mode, budget] = torch.cat(trainer.score(batch))
    assert torch.equal(scores["strict", 0].view(torch.int32), scores["strict", 50].view(torch.int32))
    print("native scores differing between whole batch and micro-batches:",
          int((scores["native", 0] != scores["native", 50]).sum()), "of", scores["native", 0].numel())


def test_micro_batches_accumulate_the_batch_update(checkpoint, strict_run):
    """An update in micro-batches of at most 50 tokens (three backward passes, gradients accumulated; every mean over
    tokens divided by the whole batch's count) is deterministic run to run, bit for bit, and is the whole-batch update
    up to the order its gradients are summed in: losses, metrics and grad norms within float32 rounding, and every
    weight but a rare few. AdamW steps each element by m / sqrt(v), whatever the gradient's size: an element whose
    gradient cancels to the rounding floor (seen on an AMD EPYC: embedding element (15, 47), gradient ~1e-9 against a
    median of 5e-5, the two sum orders 5 % apart) moves by an amount the sum order decides, up to lr a step. So at
    most one element in 10,000 of a tensor may leave float32 rounding, none by more than 2 lr a step; a micro-batch
    whose gradient were lost or doubled would move thousands."""
    with threads(2):
        a, b = _train(checkpoint, micro_batch_tokens=50), _train(checkpoint, micro_batch_tokens=50)
    _equal_runs(a, b)
    for whole, parts in zip(strict_run["metrics"], a["metrics"]):
        for k in ("loss", "grad_norm", "kl", "entropy", "clip_fraction", "approx_kl_old", "tis_weight_mean", "ratio_max"):
            assert abs(whole[k] - parts[k]) <= 1e-5 * max(1.0, abs(whole[k])), (k, whole[k], parts[k])
        assert parts["tokens"] == whole["tokens"] and (parts["micro_batches"], whole["micro_batches"]) == (3, 1)
    moved = floor = 0
    for name, w in strict_run["weights"].items():
        v = a["weights"][name]
        beyond = int((~torch.isclose(w, v, rtol=1e-4, atol=1e-6)).sum())
        assert beyond <= max(1, w.numel() // 10_000), (name, beyond, w.numel())
        assert float((w - v).abs().max()) <= 2 * 1e-3 * STEPS, name  # lr 1e-3 (_train)
        moved += int(not torch.equal(w, v))
        floor += beyond
    print("tensors whose bits differ from the whole-batch update:", moved, "of", len(strict_run["weights"]),
          "; elements beyond float32 rounding (gradients at the rounding floor):", floor)


def test_bf16_updates_go_through_float32_master_weights(checkpoint):
    """bf16 without Megatron's optimizer (the CPU; CUDA at CP > 1 or with token segments): AdamW steps float32 masters
    and rounds them once into the parameters. An update of 1e-5 on weights of ~0.08 is below half a bf16 place for most
    of them: the masters move nearly everywhere while the bf16 parameters move almost nowhere — what stepping the bf16
    parameters in place would have kept (nothing). The masters travel in state_dict: a resumed trainer continues from
    them, bit for bit."""
    from vime.trainer import MasterWeightsAdamW

    cfg = dict(dtype="bfloat16", lr=1e-5, seed=7, threads=2, grpo=GRPO, micro_batch_tokens=50)
    with MegatronTrainer(TrainerConfig(**cfg)) as t:
        t.load_hf(checkpoint)
        opt = t.optimizer
        assert isinstance(opt, MasterWeightsAdamW) and any(m is not p for p, m in zip(opt.params, opt.masters))
        p0 = [p.detach().clone() for p in opt.params]
        t.update(_batch(0))
        moved_m = moved_p = n = 0
        for p, m, w in zip(opt.params, opt.masters, p0):
            if m is p:
                continue
            assert m.dtype == torch.float32 and torch.equal(p.detach(), m.detach().to(p.dtype)), "one rounding"
            moved_m += int((m.detach() != w.float()).sum())
            moved_p += int((p.detach() != w).sum())
            n += w.numel()
        assert moved_m > 0.9 * n and moved_p < 0.2 * n, (moved_m, moved_p, n)
        state = copy.deepcopy(t.optimizer.state_dict())  # (a checkpoint writes it out; the live one moves on)
        t.update(_batch(1))
        after = [m.detach().clone() for m in t.optimizer.masters]
    with MegatronTrainer(TrainerConfig(**cfg)) as r:  # resumed: weights of step 1 (rounded) + the saved state
        r.load_hf(checkpoint)
        r.optimizer.load_state_dict(state)
        with torch.no_grad():  # the checkpoint's weights: the masters rounded
            for p, m in zip(r.optimizer.params, r.optimizer.masters):
                p.copy_(m)
        r.weight_version = 1
        r.update(_batch(1))
        assert all(torch.equal(a, m.detach()) for a, m in zip(after, r.optimizer.masters))


def test_nonfinite_update_in_micro_batches_with_master_weights_never_steps(tmp_path):
    """The same refusals when the update runs in micro-batches (trainer micro_batch_tokens: the inputs' census spans all
    of them) and steps bf16 parameters through float32 masters: nothing stepped, no gradient left in the parameters or
    the masters, and the next step is normal."""
    ckpt = make_tiny_checkpoint(tmp_path, vocab_size=128, seed=5)
    with MegatronTrainer(TrainerConfig(lr=1e-3, seed=0, dtype="bfloat16", micro_batch_tokens=15)) as t:
        t.load_hf(ckpt)
        for batch, what, culprit in ((_adv_batch([1.0, NAN, -1.0, 0.5]), "loss", r"advantages 1/4"),
                                     (_adv_batch([1e30, -1e30, 1e30, -1e30]), "global grad norm", r"advantages 0/4")):
            before = t.export_weights(0)
            with pytest.raises(NonFiniteUpdateError, match=f"the {what} is .*optimizer was not stepped.*{culprit}"):
                t.update(batch)
            after = t.export_weights(0)
            assert t.weight_version == 0 and t.optimizer.state_dict()["adamw"]["state"] == {}
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert all(p.grad is None for p in t.model.parameters()) and all(m.grad is None for m in t.optimizer.masters)
        good = t.update(_adv_batch([1.0, -1.0, 0.5, -0.5]))
        assert good["weight_version"] == 1 and good["micro_batches"] == 4 and math.isfinite(good["grad_norm"]) and good["grad_norm"] > 0
