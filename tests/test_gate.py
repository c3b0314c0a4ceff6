"""Claims: the comparability gate passes a consistent step and names what differs otherwise
(weight version on either side, tokens, mask); such a step is never compared."""
import numpy as np
import torch

from vime.batch import TrainBatch
from vime.controller import comparability
from vime.records import SamplingSpec, TokenRecord


def _records(version=3):
    return [TokenRecord(record_id=f"0-0-{i}", step=0, prompt_id="p", group_id=0, sample_idx=i, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                        loss_mask=[1, 1, 1], rollout_logprobs=np.zeros(3, np.float32), weight_versions=[version] * 3, engine_id="e",
                        sampling=SamplingSpec()) for i in range(2)]


def test_gate():
    recs = _records()
    batch = TrainBatch.from_records(recs)
    assert comparability(recs, batch, 3, 3)["comparable"]
    res = comparability(recs, batch, 4, 3)
    assert not res["comparable"] and "weight version" in res["reasons"][0]
    stale = _records()
    stale[1].weight_versions = [2, 3, 3]
    assert not comparability(stale, batch, 3, 3)["comparable"]
    other = TrainBatch.from_records(_records())
    other.sequences[0] = [1, 2, 3, 4, 9]
    res = comparability(recs, other, 3, 3)
    assert not res["comparable"] and "tokens" in res["reasons"][0]
    other = TrainBatch.from_records(_records())
    other.loss_mask[1] = torch.ones(2)
    other.sequences[1] = [1, 2, 3, 4]
    assert not comparability(recs, other, 3, 3)["comparable"]
