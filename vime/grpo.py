"""GRPO: group-relative advantages and the clipped policy loss.

What this module decides: the formulas, nothing else (no model, no engine).
Token-level mean over the loss mask (DAPO style), PPO clip with separate low
and high epsilons, KL to a reference policy with the k1 / k3 / low_var_kl
estimators, optional entropy bonus, optional truncated importance sampling
(TIS) against the rollout engine's logprobs for non-strict runs. Sums over
tokens are rlkernel trees, so the loss and its gradient are bitwise
deterministic whatever the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel import tree_sum

KL_ESTIMATORS = ("k1", "k3", "low_var_kl")


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    clip_eps_low: float = 0.2  # ratio lower bound 1 - eps_low
    clip_eps_high: float = 0.28  # ratio upper bound 1 + eps_high (DAPO clip-higher)
    kl_coef: float = 0.0  # weight of the KL-to-reference term (0: no reference pass)
    kl_estimator: str = "low_var_kl"  # one of KL_ESTIMATORS
    entropy_coef: float = 0.0  # entropy bonus weight
    tis_cap: float | None = None  # truncated IS cap on exp(old - rollout); None: off
    adv_eps: float = 1e-6  # std normaliser floor
    normalize_adv_std: bool = True  # divide by the group std (GRPO); False: Dr.GRPO-style

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0 or self.clip_eps_low >= 1:
            raise ValueError("clip epsilons must satisfy 0 <= eps_low < 1 and eps_high >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be > 0 or None")


def group_advantages(rewards: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """rewards [groups, samples] -> advantages of the same shape: (r - mean) / (std + eps)."""
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [groups, samples], got {tuple(rewards.shape)}")
    r = rewards.double()
    adv = r - r.mean(dim=1, keepdim=True)
    if cfg.normalize_adv_std:
        std = r.std(dim=1, keepdim=True, unbiased=False) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + cfg.adv_eps)
    return adv.float()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled-token logprobs."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    k3 = torch.exp(log_ratio) - log_ratio - 1
    return k3 if estimator == "k3" else torch.clamp(k3, -10.0, 10.0)


def token_count(mask: torch.Tensor) -> torch.Tensor:
    """The masked means' denominator: the mask's sum (a 0-d tensor), at least 1."""
    return tree_sum(mask.float().reshape(-1), dim=0).clamp_min(1.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | None = None) -> torch.Tensor:
    return tree_sum((x * mask).reshape(-1), dim=0) / (token_count(mask) if denominator is None else denominator)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    read_back: bool = True,
    denominator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level GRPO loss. All inputs are per token [T] (advantages broadcast per token).

    logprobs: current policy (requires grad); old_logprobs: the policy that is the ratio's
    denominator (training engine's recompute, or the rollout's when use_rollout_logprobs);
    rollout_logprobs: needed only for TIS. read_back=False: the metrics stay 0-d tensors on the
    loss's device (`read_metrics` turns them into floats in one read): a trainer on a GPU reads
    them after its optimizer step, so the host is not made to wait for the forward before it
    launches the backward. denominator: what the masked means divide by (default: this mask's
    `token_count`); a micro-batch passes the whole batch's, so the micro-batches' losses and mean
    metrics add up to the batch's (`combine_metrics`).
    """
    mask = mask.float()
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg1, pg2 = -advantages * ratio, -advantages * clipped
    pg = torch.maximum(pg1, pg2)
    metrics = {}
    if cfg.tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap is set but no rollout_logprobs were given")
        w = torch.clamp(torch.exp(old_logprobs - rollout_logprobs), max=cfg.tis_cap).detach()
        pg = pg * w
        metrics["tis_weight_mean"] = _masked_mean(w, mask, denominator)
    loss_tok = pg
    if cfg.kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss_tok = loss_tok + cfg.kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask, denominator)
    if cfg.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        loss_tok = loss_tok - cfg.entropy_coef * entropy
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), mask, denominator)
    loss = _masked_mean(loss_tok, mask, denominator)
    with torch.no_grad():
        metrics["clip_fraction"] = _masked_mean((pg2 > pg1).float(), mask, denominator)
        metrics["approx_kl_old"] = _masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask, denominator)
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)  # no token: 1.0, decided on the device (no read)
        metrics["ratio_max"] = torch.where(mask.any(), (ratio * mask).max(), one) if ratio.numel() else one
    return loss, (read_metrics(metrics) if read_back else metrics)


MAX_METRICS = ("ratio_max",)  # combined over micro-batches by max; every other grpo_loss metric is a masked mean


def combine_metrics(parts: list[dict]) -> dict:
    """grpo_loss's metrics of the micro-batches of one batch (each called with the batch's `denominator`) as the
    batch's: the masked means added in micro-batch order, the maxima by max. One part: itself."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        if k in MAX_METRICS:
            out[k] = torch.stack(vals).max() if isinstance(vals[0], torch.Tensor) else max(vals)
        else:
            total = vals[0]
            for v in vals[1:]:
                total = total + v
            out[k] = total
    return out


def read_metrics(metrics: dict) -> dict[str, float]:
    """0-d metric tensors (grpo_loss(read_back=False)) as floats, in one device-to-host read; floats pass through."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return dict(metrics)
    vals = torch.stack([metrics[k].detach().float() for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, vals))}
