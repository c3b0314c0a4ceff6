"""Claims: the comparability gate compares two independent descriptions of a step — the digest
the real Megatron trainer computes from the tensors it fed its model, and the digest built from
the rollout's records and the engine's vocab — so it can fail in production:
1. a consistent step passes (every digest field equal);
2. a batch altered between the records and the trainer (a token, a sequence boundary, the loss
   mask), a trainer at another weight version, or an engine with another vocab fails the gate,
   and the reason names the differing field; records of mixed or other versions fail too;
3. a step that fails the gate is never compared: its mismatch numbers are null, not 0."""
import numpy as np
import pytest
import torch

from vime.batch import TrainBatch
from vime.gate import comparability, rollout_digest
from vime.metrics import not_compared
from vime.records import SamplingSpec, TokenRecord
from vime.tiny_model import make_tiny_checkpoint
from vime.trainer import MegatronTrainer, TrainerConfig

VOCAB = 128


def _records(version=0, lens=((3, 5), (6, 4), (2, 7))):
    g = np.random.default_rng(0)
    return [TokenRecord(record_id=f"0-0-{i}", step=0, prompt_id="p", group_id=0, sample_idx=i,
                        prompt_ids=g.integers(4, VOCAB, p).tolist(), response_ids=g.integers(4, VOCAB, r).tolist(),
                        loss_mask=[1] * r, rollout_logprobs=np.zeros(r, np.float32), weight_versions=[version] * r, engine_id="e",
                        sampling=SamplingSpec()) for i, (p, r) in enumerate(lens)]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("gate"), vocab_size=VOCAB, seed=3)
    with MegatronTrainer(TrainerConfig(lr=1e-3, seed=0)) as t:
        t.load_hf(ckpt)
        yield t


def _gate(trainer, records, batch, rollout_version=0, vocab=VOCAB):
    scored = trainer.score_with_digest(batch)
    return comparability(records, scored.digest, scored.weight_version, rollout_version, vocab), scored


def test_consistent_step_passes(trainer):
    recs = _records()
    res, scored = _gate(trainer, recs, TrainBatch.from_records(recs))
    assert res["comparable"] and res["reasons"] == [] and res["scored_weight_version"] == 0
    assert rollout_digest(recs, VOCAB).differing(scored.digest) == []


def _altered(recs, how):
    b = TrainBatch.from_records(recs)
    if how == "token":  # one response token changed in transit
        b.sequences[1][-1] = (b.sequences[1][-1] + 1) % VOCAB
    elif how == "boundary":  # the same token stream cut at another place: sample 0 takes sample 1's first token
        first = b.sequences[1].pop(0)
        b.sequences[0].append(first)
        b.prompt_lens[1] -= 1
        b.loss_mask[0] = torch.ones(b.loss_mask[0].numel() + 1)
    elif how == "mask":
        b.loss_mask[2][0] = 0.0
    return b


@pytest.mark.parametrize("how,field", [("token", "tokens"), ("boundary", "positions"), ("mask", "loss_mask")])
def test_altered_batch_fails_the_gate(trainer, how, field):
    recs = _records()
    res, scored = _gate(trainer, recs, _altered(recs, how))
    assert not res["comparable"]
    assert field in rollout_digest(recs, VOCAB).differing(scored.digest)
    assert any(field in r and "digest mismatch" in r for r in res["reasons"])


def test_other_vocab_fails_the_gate(trainer):
    recs = _records()
    res, _ = _gate(trainer, recs, TrainBatch.from_records(recs), vocab=VOCAB + 1)
    assert not res["comparable"] and "vocab" in res["reasons"][0]


def test_versions_fail_the_gate(trainer):
    stale = _records()
    stale[1].weight_versions = [0, 1, 1, 1]
    res, _ = _gate(trainer, stale, TrainBatch(sequences=[r.prompt_ids + r.response_ids for r in stale], prompt_lens=[len(r.prompt_ids) for r in stale],
                                               loss_mask=[torch.ones(len(r.response_ids)) for r in stale], temperature=1.0, weight_version=0))
    assert not res["comparable"] and "weight version" in res["reasons"][0] and "weight_version" in res["reasons"][1]
    recs = _records()
    res, _ = _gate(trainer, recs, TrainBatch.from_records(recs), rollout_version=1)  # rollout says 1, records and trainer 0
    assert not res["comparable"] and "weight version: rollout 1, trainer 0" in res["reasons"][0]


def test_trainer_at_another_version_fails_the_gate(trainer):
    """The trainer moved on (an update happened) before scoring records of version 0."""
    recs = _records()
    batch = TrainBatch.from_records(recs, advantages=torch.tensor([1.0, -1.0, 0.5]))
    w0 = trainer.export_weights(0)
    try:
        trainer.update(batch)
        res, scored = _gate(trainer, recs, batch)
    finally:
        trainer.load_weights(w0, 0)  # the module's trainer goes back to version 0 for the other tests
    assert scored.weight_version == 1 and not res["comparable"]
    assert "weight_version" in rollout_digest(recs, VOCAB).differing(scored.digest)


def test_the_loop_compares_only_what_passes_the_gate(trainer):
    """The controller's own step (vime.controller.compare_step): a passing step gets numbers, an altered batch gets
    null numbers and the reason — whatever the logprobs hold."""
    from vime.controller import compare_step

    recs = _records()
    ok_cmp, ok = compare_step(recs, trainer.score_with_digest(TrainBatch.from_records(recs)), 0, VOCAB)
    assert ok_cmp["comparable"] and ok["compared_tokens"] == sum(len(r.response_ids) for r in recs) and ok["mismatch_count"] > 0
    bad_cmp, bad = compare_step(recs, trainer.score_with_digest(_altered(recs, "token")), 0, VOCAB)
    assert not bad_cmp["comparable"] and bad == not_compared() and any("tokens" in r for r in bad_cmp["reasons"])


def test_uncompared_step_has_null_numbers():
    assert not_compared() == {"mismatch_count": None, "nonfinite_tokens": None, "max_abs_diff": None, "mean_abs_diff": None,
                              "compared_tokens": 0}
