"""The training batch: what the trainer scores and updates on, and what scoring returns.

What this module decides: how versioned token records become the packed
sequences the training engine sees, and which tokens are scored (every
response token; the prompt is context only). Per-sample tensors stay per
sample (lists), so no padding convention leaks between roles. `Scored` is the
trainer's answer: logprobs, the version they were computed with, and the
digest of what was actually scored (the comparability gate's evidence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gate import ScoreDigest
from .records import TokenRecord


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    sequences: list[list[int]]  # per sample: prompt + response token ids
    prompt_lens: list[int]  # per sample: number of prompt tokens (>= 1)
    loss_mask: list[torch.Tensor]  # per sample: [R] float32, 1 = trained on
    temperature: float  # sampling temperature; logprobs are of softmax(logits / temperature)
    weight_version: int  # weight version the rollout generated with
    advantages: torch.Tensor | None = None  # [B] float32, one per sample (GRPO)
    rollout_logprobs: list[torch.Tensor] | None = None  # per sample [R] float32, from the rollout engine
    old_logprobs: list[torch.Tensor] | None = None  # per sample [R] float32, the ratio's denominator

    def __post_init__(self):
        if not (len(self.sequences) == len(self.prompt_lens) == len(self.loss_mask)):
            raise ValueError("TrainBatch: per-sample fields disagree in length")
        for i, (s, p, m) in enumerate(zip(self.sequences, self.prompt_lens, self.loss_mask)):
            if not 1 <= p < len(s) or m.shape[0] != len(s) - p:
                raise ValueError(f"TrainBatch: sample {i} has {len(s)} tokens, prompt {p}, mask {tuple(m.shape)}")

    @property
    def response_lens(self) -> list[int]:
        return [len(s) - p for s, p in zip(self.sequences, self.prompt_lens)]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @classmethod
    def from_records(cls, records: list[TokenRecord], advantages: torch.Tensor | None = None) -> "TrainBatch":
        if not records:
            raise ValueError("TrainBatch.from_records: no records")
        temps = {r.sampling.temperature for r in records}
        versions = {v for r in records for v in r.weight_versions}
        if len(temps) != 1:
            raise ValueError(f"TrainBatch: records mix sampling temperatures {sorted(temps)}")
        if len(versions) > 1:
            raise ValueError(f"TrainBatch: records mix weight versions {sorted(versions)}")
        return cls(
            sequences=[list(r.prompt_ids) + list(r.response_ids) for r in records],
            prompt_lens=[len(r.prompt_ids) for r in records],
            loss_mask=[torch.tensor(r.loss_mask, dtype=torch.float32) for r in records],
            temperature=temps.pop(),
            weight_version=versions.pop() if versions else -1,
            advantages=advantages,
            rollout_logprobs=[torch.from_numpy(r.rollout_logprobs.copy()) for r in records],
        )

    def micro_batches(self, max_tokens: int) -> list["TrainBatch"]:
        """The batch cut into consecutive runs of whole samples of at most `max_tokens` tokens each (prompt + response;
        a sample longer than that is a run of its own), in order — a function of the batch and `max_tokens` alone, so
        every rank and every run cuts it alike. 0: the batch itself. What the trainer's forwards and backwards take one
        at a time (trainer.micro_batch_tokens): activation memory bounded by the budget, not the batch."""
        if max_tokens < 0:
            raise ValueError(f"micro_batches: max_tokens must be >= 0 (0: one micro-batch), got {max_tokens}")
        if not max_tokens or self.num_tokens <= max_tokens:
            return [self]
        cuts, used = [0], 0
        for i, seq in enumerate(self.sequences):
            if used and used + len(seq) > max_tokens:
                cuts.append(i)
                used = 0
            used += len(seq)
        cuts.append(len(self.sequences))
        return [self.select(a, b) for a, b in zip(cuts[:-1], cuts[1:])]

    def select(self, a: int, b: int) -> "TrainBatch":
        """Samples a .. b-1 (every per-sample field sliced alike)."""
        def part(x):
            return None if x is None else x[a:b]

        return TrainBatch(sequences=self.sequences[a:b], prompt_lens=self.prompt_lens[a:b], loss_mask=self.loss_mask[a:b],
                          temperature=self.temperature, weight_version=self.weight_version, advantages=part(self.advantages),
                          rollout_logprobs=part(self.rollout_logprobs), old_logprobs=part(self.old_logprobs))

    # Pickling (Ray moves batches between roles): each per-sample list travels as one flat
    # tensor plus lengths. Ray serialises every tensor of a list on its own (measured: 256
    # five-element tensors cost 146 ms a call, one tensor 4 ms); values are unchanged.
    _LISTS = ("loss_mask", "rollout_logprobs", "old_logprobs")

    def __getstate__(self) -> dict:
        state = {f: getattr(self, f) for f in self.__slots__}
        for f in self._LISTS:
            if state[f] is not None:
                state[f] = pack_tensors(state[f])
        return state

    def __setstate__(self, state: dict) -> None:
        for f in self.__slots__:
            v = state[f]
            setattr(self, f, unpack_tensors(v) if f in self._LISTS and v is not None else v)


@dataclass(kw_only=True, slots=True)
class Scored:
    logprobs: list[torch.Tensor]  # per sample [R] float32, log p(response token | prefix)
    weight_version: int  # the trainer's weight version when it scored
    digest: ScoreDigest  # what the trainer actually scored (vime.gate)

    def __getstate__(self) -> dict:  # one flat tensor across processes (see TrainBatch)
        return {"logprobs": pack_tensors(self.logprobs), "weight_version": self.weight_version, "digest": self.digest}

    def __setstate__(self, state: dict) -> None:
        self.logprobs, self.weight_version, self.digest = unpack_tensors(state["logprobs"]), state["weight_version"], state["digest"]


def pack_tensors(xs: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One flat tensor and the lengths of a list of 1-D tensors (cheap to move between processes)."""
    return (torch.cat(xs) if xs else torch.zeros(0)), [int(x.shape[0]) for x in xs]


def unpack_tensors(packed: tuple[torch.Tensor, list[int]]) -> list[torch.Tensor]:
    flat, lens = packed
    return list(flat.split(lens)) if lens else []
