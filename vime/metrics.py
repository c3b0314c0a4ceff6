"""Rollout-vs-training logprob comparison: the numbers users watch.

What this module decides: what "mismatch" means. Two float32 logprobs match
only if both are finite and their bits are equal (-0.0 vs 0.0 is a mismatch).
A NaN or ±inf on either side is always a mismatch, even when both sides hold
the same bit pattern (a diverged model would otherwise "match" itself), and is
counted in `nonfinite_tokens`. No NaN is skipped: when any compared token is
non-finite, `max_abs_diff` and `mean_abs_diff` are +inf, never the maximum of
the finite rest. A step whose inputs are not comparable has no numbers at all
(`not_compared`: None, logged as null), never zeros.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def _f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def compare_logprobs(rollout: Sequence, train: Sequence, masks: Sequence | None = None) -> dict:
    """Per-token bitwise comparison over all samples; masks (optional) select compared tokens."""
    if len(rollout) != len(train):
        raise ValueError(f"compare_logprobs: {len(rollout)} rollout samples vs {len(train)} training samples")
    mism, nonfinite, compared, max_abs, sum_abs = 0, 0, 0, 0.0, 0.0
    for i, (a, b) in enumerate(zip(rollout, train)):
        a, b = _f32(a), _f32(b)
        if a.shape != b.shape:
            raise ValueError(f"compare_logprobs: sample {i} has {a.shape} rollout vs {b.shape} training logprobs")
        keep = np.ones(a.shape, dtype=bool) if masks is None else np.asarray(masks[i], dtype=bool)
        a, b = a[keep], b[keep]
        bad = ~(np.isfinite(a) & np.isfinite(b))
        mism += int(np.count_nonzero((a.view(np.uint32) != b.view(np.uint32)) | bad))
        nonfinite += int(np.count_nonzero(bad))
        compared += a.size
        if a.size and not bad.any():
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            max_abs, sum_abs = max(max_abs, float(diff.max())), sum_abs + float(diff.sum())
    if nonfinite:
        max_abs = sum_abs = float("inf")
    return {
        "mismatch_count": mism,
        "nonfinite_tokens": nonfinite,
        "max_abs_diff": max_abs,
        "mean_abs_diff": sum_abs / compared if compared else 0.0,
        "compared_tokens": compared,
    }


def not_compared() -> dict:
    """The numbers of a step that failed the comparability gate: unknown (null), not zero."""
    return {"mismatch_count": None, "nonfinite_tokens": None, "max_abs_diff": None, "mean_abs_diff": None, "compared_tokens": 0}
