"""Claims: token records round-trip through Parquet with float32 logprobs bit-exact and
every field intact; inconsistent records and sampler settings are rejected."""
import numpy as np
import pytest

from vime.records import SamplingSpec, Status, TokenRecord, read_records, write_records


def _rec(i, n=5):
    rng = np.random.default_rng(i)
    return TokenRecord(record_id=f"0-{i}-0", step=0, prompt_id=f"p{i}", group_id=i, sample_idx=0,
                       prompt_ids=[1, 2, 3], response_ids=list(range(n)), loss_mask=[1] * n,
                       rollout_logprobs=-rng.random(n, dtype=np.float32) * 10, weight_versions=[i] * n,
                       engine_id="vllm-0", sampling=SamplingSpec(temperature=0.7, seed=i), reward=0.5 * i,
                       status=Status.TRUNCATED if i else Status.OK, finish_reason="length", response_text="abc")


def test_parquet_round_trip_is_exact(tmp_path):
    recs = [_rec(i) for i in range(4)] + [_rec(9, n=0)]
    back = read_records(write_records(recs, tmp_path / "step_0.parquet"))
    assert len(back) == len(recs)
    for a, b in zip(recs, back):
        assert a.rollout_logprobs.tobytes() == b.rollout_logprobs.tobytes()
        for name in ("record_id", "prompt_ids", "response_ids", "weight_versions", "sampling", "reward", "status", "loss_mask"):
            assert getattr(a, name) == getattr(b, name), name
    assert not (tmp_path / "step_0.tmp").exists()


def test_inconsistent_records_are_rejected():
    with pytest.raises(ValueError):
        TokenRecord(record_id="x", step=0, prompt_id="p", group_id=0, sample_idx=0, prompt_ids=[1], response_ids=[1, 2],
                    loss_mask=[1], rollout_logprobs=[0.0, 0.0], weight_versions=[0, 0], engine_id="e", sampling=SamplingSpec())
    with pytest.raises(ValueError):
        SamplingSpec(temperature=0)
    with pytest.raises(ValueError):
        SamplingSpec(top_p=1.5)
