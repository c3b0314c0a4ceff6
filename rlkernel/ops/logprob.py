"""Linear-logprob: hidden x lm_head -> float32 logprobs, entropy (contract: rlkernel/contracts/logprob.py)."""
from __future__ import annotations

import torch

from .. import dispatch
from ._dtypes import data_dtype


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, vocab_size: int | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 log p(targets) under softmax(hidden @ weight[:vocab_size].T / temperature).

    hidden [T, H]; weight [V_padded, H]; targets [T] int64 in [0, vocab_size).
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    data_dtype("linear_logprob", hidden=hidden, weight=weight)
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprob: want hidden [T, H] and targets [T]; got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    if not 0 < vocab_size <= weight.shape[0] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"linear_logprob: weight {tuple(weight.shape)} does not fit hidden {hidden.shape[1]} / vocab_size {vocab_size}")
    if not temperature > 0:
        raise ValueError(f"linear_logprob: temperature must be > 0, got {temperature}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"linear_logprob: targets must be an integer tensor, got {targets.dtype}")
    if targets.numel():
        if targets.is_cuda:  # checked on the device: reading the targets back would sync every decode step
            torch._assert_async(((targets >= 0) & (targets < vocab_size)).all(), "linear_logprob: targets outside the vocab")
        elif int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
            raise ValueError(f"linear_logprob: targets outside [0, {vocab_size})")
    return dispatch.call("linear_logprob", backend, (hidden, weight, targets), "targets", hidden, weight, targets.long(), float(temperature), vocab_size)


def linear_logprobs_full(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0, *, vocab_size: int | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 [T, vocab_size] log-softmax of hidden @ weight[:vocab_size].T / temperature.

    Element [t, v] is bitwise equal to `linear_logprob(hidden, weight, targets)` at row t with
    targets[t] = v: a rollout engine that samples from this table reports exactly the value the
    trainer recomputes. Materialises the whole table: for sampling, not for training.
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    data_dtype("linear_logprobs_full", hidden=hidden, weight=weight)
    if hidden.dim() != 2 or weight.shape[1] != hidden.shape[1] or not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_logprobs_full: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, vocab_size {vocab_size}")
    if not temperature > 0:
        raise ValueError(f"linear_logprobs_full: temperature must be > 0, got {temperature}")
    return dispatch.call("linear_logprob", backend, (hidden, weight), "full", hidden, weight, None, float(temperature), vocab_size)


def linear_entropy(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0, *, vocab_size: int | None = None, backend: str | None = None) -> torch.Tensor:
    """float32 [T] entropy of softmax(hidden @ weight[:vocab_size].T / temperature), differentiable,
    computed tile by tile under the linear-logprob contract (for the GRPO entropy bonus and metrics)."""
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    data_dtype("linear_entropy", hidden=hidden, weight=weight)
    if hidden.dim() != 2 or weight.shape[1] != hidden.shape[1] or not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, vocab_size {vocab_size}")
    if not temperature > 0:
        raise ValueError(f"linear_entropy: temperature must be > 0, got {temperature}")
    return dispatch.call("linear_logprob", backend, (hidden, weight), "entropy", hidden, weight, None, float(temperature), vocab_size)
