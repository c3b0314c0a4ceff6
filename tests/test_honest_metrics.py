"""Claims: the numbers cannot say 0 when nothing was proved.
1. A NaN or ±inf logprob on either side is a mismatch — even when both sides hold the same bit
   pattern — and is counted in `nonfinite_tokens`; a partial NaN makes max/mean |diff| +inf
   instead of being skipped; masked-out tokens are not compared.
2. A non-comparable step is logged as `mismatch_count: null`, `max_abs_diff: null` in
   metrics.jsonl and the progress bar shows `mismatch=n/a`.
3. Through the real Megatron trainer on a tiny model: a NaN advantage (loss NaN), huge
   advantages (finite loss, infinite grad norm) and NaN weights each stop the update with
   `NonFiniteUpdateError` before the optimizer steps — weights bitwise unchanged, version
   unchanged, no optimizer state — and the trainer takes the next finite step normally. NaN
   weights also show up in the comparison as non-finite mismatches.
4. The G01 arm with TIS (`use_rollout_logprobs=true` + `tis_cap`), where TIS is a no-op, is
   rejected at config load, naming both fields and the fix; G00 + TIS loads."""
import json
import math

import numpy as np
import pytest
import torch

from vime.batch import TrainBatch
from vime.config import ConfigError, load_config
from vime.metrics import compare_logprobs, not_compared
from vime.sinks import MetricSinks, postfix
from vime.tiny_model import make_tiny_checkpoint
from vime.trainer import MegatronTrainer, NonFiniteUpdateError, TrainerConfig

NAN = float("nan")


def test_nonfinite_logprobs_are_mismatches():
    a = np.array([-1.0, NAN, -2.0, -np.inf], np.float32)
    same = compare_logprobs([a], [a.copy()])  # identical bits, NaN and -inf included
    assert (same["mismatch_count"], same["nonfinite_tokens"], same["compared_tokens"]) == (2, 2, 4)
    assert same["max_abs_diff"] == math.inf and same["mean_abs_diff"] == math.inf
    one_side = compare_logprobs([np.array([-1.0, -2.0], np.float32)], [np.array([-1.0, np.inf], np.float32)])
    assert (one_side["mismatch_count"], one_side["nonfinite_tokens"], one_side["max_abs_diff"]) == (1, 1, math.inf)
    # a partial NaN in one sample does not hide behind the finite rest of the step (nanmax did)
    partial = compare_logprobs([np.array([-1.0, -3.0], np.float32), np.array([-1.0], np.float32)],
                               [np.array([-1.5, NAN], np.float32), np.array([-1.0], np.float32)])
    assert (partial["mismatch_count"], partial["nonfinite_tokens"], partial["max_abs_diff"]) == (2, 1, math.inf)
    masked = compare_logprobs([a], [a.copy()], masks=[[1, 0, 1, 0]])
    assert masked == {"mismatch_count": 0, "nonfinite_tokens": 0, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "compared_tokens": 2}
    signed_zero = compare_logprobs([np.array([0.0], np.float32)], [np.array([-0.0], np.float32)])
    assert signed_zero["mismatch_count"] == 1 and signed_zero["nonfinite_tokens"] == 0


def test_uncompared_step_logs_null_and_na(tmp_path):
    cfg, plain = load_config("grpo_tiny", [f"run.output_dir={tmp_path}", "logging.wandb=false"])
    sinks = MetricSinks(tmp_path, cfg, plain, total=2, start=0)
    try:
        base = {"reward_mean": 0.5, "weight_version": 1, "comparable": False}
        sinks.log({"step": 0, **base, **not_compared()})
        assert "mismatch=n/a" in sinks.bar.postfix
        sinks.log({"step": 1, **base, "comparable": True, **compare_logprobs([np.zeros(3, np.float32)], [np.zeros(3, np.float32)])})
        assert "mismatch=0" in sinks.bar.postfix
    finally:
        sinks.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"mismatch_count": null' in lines[0] and '"max_abs_diff": null' in lines[0]
    first, second = (json.loads(x) for x in lines)
    assert first["mismatch_count"] is None and first["max_abs_diff"] is None and first["compared_tokens"] == 0
    assert second["mismatch_count"] == 0 and postfix(second)["mismatch"] == 0


def test_a_step_that_compiled_kernels_says_so(tmp_path, capsys, monkeypatch):
    """A step whose trainer spent >= 10 s in first launches of rlkernel's Triton kernels (a cold machine's first step)
    says so under the progress bar, naming Triton's cache; shorter ones and CPU runs (time_compile None) say nothing.
    And a problem (here: steps not compared) is said once, at its first step, with its reason."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tc"))
    cfg, plain = load_config("grpo_tiny", [f"run.output_dir={tmp_path}", "logging.wandb=false"])
    sinks = MetricSinks(tmp_path, cfg, plain, total=3, start=0)
    try:
        base = {"reward_mean": 0.5, "weight_version": 1, "comparable": False, "not_comparable_reasons": ["stale_weights"],
                **not_compared()}
        sinks.log({"step": 0, **base, "time_step": 131.0, "time_compile": 124.6})
        sinks.log({"step": 1, **base, "time_step": 0.5, "time_compile": 0.2})
        sinks.log({"step": 2, **base, "time_step": 0.5, "time_compile": None})
    finally:
        sinks.close()
    err = capsys.readouterr().err.splitlines()
    said = [x for x in err if x.startswith("vime: step") and "compiling" in x]
    assert said == [f"vime: step 0 spent 125 s of its 131 s compiling rlkernel's Triton kernels for this GPU (once per "
                    f"machine: Triton caches them; cache: {tmp_path / 'tc'})"], said
    problems = [x for x in err if x.startswith("vime: step") and "compiling" not in x]
    assert len(problems) == 1 and problems[0].startswith("vime: step 0: not compared: stale_weights (later steps"), problems


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("nan"), vocab_size=128, seed=5)
    with MegatronTrainer(TrainerConfig(lr=1e-3, seed=0)) as t:
        t.load_hf(ckpt)
        yield t


def _batch(advantages) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    lens, prompts = (9, 12, 7, 10), (3, 5, 2, 4)
    return TrainBatch(sequences=[torch.randint(4, 128, (n,), generator=g).tolist() for n in lens], prompt_lens=list(prompts),
                      loss_mask=[torch.ones(n - p) for n, p in zip(lens, prompts)], temperature=1.0, weight_version=0,
                      advantages=torch.tensor(advantages, dtype=torch.float32))


def _refused(trainer, batch, what: str, culprit: str) -> None:
    before = trainer.export_weights(trainer.weight_version)
    version = trainer.weight_version
    with pytest.raises(NonFiniteUpdateError, match=f"the {what} is .*optimizer was not stepped.*{culprit}"):
        trainer.update(batch)
    assert trainer.weight_version == version and trainer.optimizer.state_dict()["state"] == {}
    after = trainer.export_weights(version)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_nonfinite_update_never_steps(trainer):
    _refused(trainer, _batch([1.0, NAN, -1.0, 0.5]), "loss", r"advantages 1/4")  # a NaN reward's advantage
    _refused(trainer, _batch([1e30, -1e30, 1e30, -1e30]), "global grad norm", r"advantages 0/4")  # finite loss, inf grads
    good = trainer.update(_batch([1.0, -1.0, 0.5, -0.5]))  # nothing was left behind: the next step is normal
    assert good["weight_version"] == 1 == trainer.weight_version and math.isfinite(good["grad_norm"]) and good["grad_norm"] > 0


def test_nan_weights_are_mismatches_and_never_step(trainer):
    batch = _batch([1.0, -1.0, 0.5, -0.5])
    rollout = trainer.score(batch)  # what a healthy engine at this version reported
    version = trainer.weight_version
    weights = trainer.export_weights(version)
    bad = dict(weights)
    name = next(k for k in bad if "embed" in k)
    bad[name] = bad[name].clone()
    bad[name][batch.sequences[0][0]] = NAN  # the first token's embedding
    trainer.load_weights(bad, version)
    try:
        stats = compare_logprobs(rollout, trainer.score(batch))
        assert stats["nonfinite_tokens"] > 0 and stats["mismatch_count"] >= stats["nonfinite_tokens"] and stats["max_abs_diff"] == math.inf
        batch.old_logprobs = rollout
        with pytest.raises(NonFiniteUpdateError, match="the loss is nan.*logprobs [1-9]"):
            trainer.update(batch)
        assert trainer.weight_version == version
    finally:
        trainer.load_weights(weights, version)


def test_tis_in_the_no_op_arm_is_rejected():
    with pytest.raises(ConfigError, match=r"algorithm\.tis_cap.*use_rollout_logprobs=true.*exp\(0\) = 1.*Fix: .*use_rollout_logprobs=false"):
        load_config("grpo_tiny", ["algorithm.use_rollout_logprobs=true", "algorithm.tis_cap=2", "rlkernel.mode=native"])
    cfg, _ = load_config("grpo_tiny", ["algorithm.tis_cap=2", "rlkernel.mode=native"])  # G00 + TIS: weight exp(recompute - rollout)
    assert cfg.algorithm.tis_cap == 2.0 and not cfg.algorithm.use_rollout_logprobs
