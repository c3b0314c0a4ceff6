"""Rollout-vs-training logprob comparison: the numbers users watch.

What this module decides: what "mismatch" means. Two float32 logprobs match
only if their bits are equal (so -0.0 vs 0.0 and NaNs count as mismatches
unless the bit patterns agree); the absolute differences are reported too.
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
    mism, compared, max_abs, sum_abs = 0, 0, 0.0, 0.0
    for i, (a, b) in enumerate(zip(rollout, train)):
        a, b = _f32(a), _f32(b)
        if a.shape != b.shape:
            raise ValueError(f"compare_logprobs: sample {i} has {a.shape} rollout vs {b.shape} training logprobs")
        keep = np.ones(a.shape, dtype=bool) if masks is None else np.asarray(masks[i], dtype=bool)
        a, b = a[keep], b[keep]
        mism += int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        compared += a.size
        if a.size:
            max_abs = max(max_abs, float(np.nanmax(diff)) if np.isfinite(diff).any() else float("inf"))
            sum_abs += float(np.nansum(diff))
    return {
        "mismatch_count": mism,
        "max_abs_diff": max_abs,
        "mean_abs_diff": sum_abs / compared if compared else 0.0,
        "compared_tokens": compared,
    }
