"""Versioned token records: every sampled token traceable to its weights and sampler.

What this module decides: the typed record that crosses role boundaries
(rollout -> buffer -> trainer -> metrics) and how a step's records are persisted
(one Parquet file per step, float32 logprobs kept bit-exact) so any batch can be
replayed. No untyped dict bags cross a role boundary.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

__all__ = ["Status", "SamplingSpec", "TokenRecord", "write_records", "read_records"]


class Status(str, enum.Enum):
    OK = "ok"  # finished by EOS / stop string
    TRUNCATED = "truncated"  # hit max_tokens
    ABORTED = "aborted"  # engine aborted the request
    STALE = "stale"  # generated under an older weight version than requested


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingSpec:
    temperature: float = 1.0  # > 0; logprobs are of softmax(logits / temperature)
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 64
    seed: int | None = None  # per-request seed (None: engine seed)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(kw_only=True, slots=True)
class TokenRecord:
    record_id: str  # unique: f"{step}-{group_id}-{sample_idx}" by default
    step: int  # training step whose rollout produced it
    prompt_id: str  # dataset id of the prompt
    group_id: int  # GRPO group (one prompt, n samples)
    sample_idx: int  # index inside the group
    prompt_ids: list[int]  # prompt token ids [P]
    response_ids: list[int]  # sampled token ids [R]
    loss_mask: list[int]  # [R] 1 = trained on
    rollout_logprobs: np.ndarray  # [R] float32, from the rollout engine
    weight_versions: list[int]  # [R] weight version that generated each token
    engine_id: str  # which rollout engine
    sampling: SamplingSpec  # sampler settings
    finish_reason: str = ""  # engine's finish reason ("stop", "length", ...)
    reward: float | None = None  # set by the reward function (0.0 when it failed: see reward_status)
    reward_status: str = "ok"  # "ok" or why the reward function failed (vime.data.reward_worker)
    status: Status = Status.OK
    response_text: str = ""  # detokenised response (for rewards and logs)

    def __post_init__(self):
        self.rollout_logprobs = np.asarray(self.rollout_logprobs, dtype=np.float32)
        n = len(self.response_ids)
        if not (len(self.loss_mask) == len(self.weight_versions) == self.rollout_logprobs.shape[0] == n):
            raise ValueError(f"record {self.record_id}: per-token fields disagree in length with {n} response tokens")


_SAMPLING = [f.name for f in fields(SamplingSpec)]


def write_records(records: list[TokenRecord], path: str | Path) -> Path:
    """Write records to a Parquet file atomically (tmp + rename)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: dict[str, list] = {f.name: [] for f in fields(TokenRecord) if f.name != "sampling"}
    cols.update({f"sampling_{k}": [] for k in _SAMPLING})
    for r in records:
        for name in cols:
            if name.startswith("sampling_"):
                cols[name].append(getattr(r.sampling, name[len("sampling_"):]))
            elif name == "status":
                cols[name].append(r.status.value)
            elif name == "rollout_logprobs":
                cols[name].append(pa.array(r.rollout_logprobs, type=pa.float32()))
            else:
                cols[name].append(getattr(r, name))
    arrays = {k: (pa.array(v, type=pa.list_(pa.float32())) if k == "rollout_logprobs" else pa.array(v)) for k, v in cols.items()}
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.table(arrays), tmp)
    os.replace(tmp, path)
    return path


def read_records(path: str | Path) -> list[TokenRecord]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    out = []
    for row in rows:
        sampling = SamplingSpec(**{k: row.pop(f"sampling_{k}") for k in _SAMPLING})
        row["status"] = Status(row["status"])
        row["rollout_logprobs"] = np.asarray(row["rollout_logprobs"], dtype=np.float32)
        out.append(TokenRecord(sampling=sampling, **row))
    return out
