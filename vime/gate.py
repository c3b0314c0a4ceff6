"""The comparability gate: what both engines must agree on before a step's numbers count.

What this module decides: the evidence a comparison rests on. Each side
describes what *it* computed, independently: the trainer hashes the packed
tensors it actually fed its model (token ids, the positions its attention
derived from cu_seqlens, the scored rows and their target tokens, the loss
mask it received, the vocab range of its logprob head, its weight version);
the controller hashes the same facts from the rollout's records (prompt +
response ids, positions 0..L-1, every response token scored, the recorded
mask and per-token weight versions) and the vocab range of the running vLLM
model. The gate compares the two digests field by field, so a batch that was
repacked, shifted, truncated or scored under other weights or another vocab
fails the gate, and the failing fields are named. A failed step is
`comparable = false`: its mismatch numbers are null, never zero.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import numpy as np


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreDigest:
    """sha256 per field of what one side scored (hex strings)."""

    tokens: str  # int64 packed token ids + int64 per-sample lengths
    positions: str  # int64 position of every packed token inside its sequence
    targets: str  # per scored row: int64 (position of the predicting token, target token id)
    loss_mask: str  # float32 [R total] loss mask of the scored tokens
    vocab: str  # int64 true vocab size the logprobs normalise over (padding excluded)
    weight_version: str  # int64 weight version of every scored token

    @classmethod
    def of(cls, *, tokens, lengths, positions, scored_positions, targets, loss_mask, vocab_size: int, versions) -> "ScoreDigest":
        i64 = lambda x: np.asarray(x, dtype=np.int64).reshape(-1)  # noqa: E731
        lens, scored = i64(lengths), i64(scored_positions)
        return cls(
            tokens=_sha(i64(tokens), lens),
            positions=_sha(i64(positions)),
            targets=_sha(np.stack([scored, i64(targets)]) if scored.size else np.zeros((2, 0), np.int64)),
            loss_mask=_sha(np.asarray(loss_mask, dtype=np.float32).reshape(-1)),
            vocab=_sha(np.array([vocab_size], dtype=np.int64)),
            weight_version=_sha(i64(versions)),
        )

    def differing(self, other: "ScoreDigest") -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def rollout_digest(records, vocab_size: int) -> ScoreDigest:
    """The digest of what the rollout generated: built from its records alone."""
    seqs = [list(r.prompt_ids) + list(r.response_ids) for r in records]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return ScoreDigest.of(
        tokens=cat([np.asarray(s, np.int64) for s in seqs]),
        lengths=[len(s) for s in seqs],
        positions=cat([np.arange(len(s)) for s in seqs]),
        scored_positions=cat([np.arange(len(r.prompt_ids) - 1, len(s) - 1) for r, s in zip(records, seqs)]),
        targets=cat([np.asarray(r.response_ids, np.int64) for r in records]),
        loss_mask=cat([np.asarray(r.loss_mask, np.float32) for r in records]),
        vocab_size=vocab_size,
        versions=cat([np.asarray(r.weight_versions, np.int64) for r in records]),
    )


def comparability(records, trainer_digest: ScoreDigest, scored_version: int, rollout_version: int, rollout_vocab: int) -> dict:
    """The gate: both sides saw the same weights, tokens, positions, targets, mask and vocab, else not comparable."""
    reasons = []
    if scored_version != rollout_version or any(set(r.weight_versions) - {rollout_version} for r in records):
        reasons.append(f"weight version: rollout {rollout_version}, trainer {scored_version}")
    differ = rollout_digest(records, rollout_vocab).differing(trainer_digest)
    if differ:
        reasons.append("trainer scored other " + ", ".join(differ) + " than the rollout generated (digest mismatch)")
    return {"comparable": not reasons, "reasons": reasons, "scored_weight_version": scored_version}
