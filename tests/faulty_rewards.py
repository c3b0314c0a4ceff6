"""Reward functions for the tests (imported by the worker process): most misbehave on purpose."""
import os
import time


def digit_share(response: str, ground_truth: str) -> float:
    """Well-behaved and text-dependent: the share of digits in the response. Unlike a correctness
    reward on a barely trained model, it differs between a group's samples, so every GRPO step
    really changes the weights (the exact-resume test needs updates that are not zero)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def by_text(response: str, ground_truth: str):
    """The response text picks the failure: raise, hang, nan, none, exit, np32 (a numpy scalar), array; otherwise exact
    match."""
    if response == "raise":
        raise ValueError("reward bug")
    if response == "hang":
        time.sleep(3600)
    if response == "nan":
        return float("nan")
    if response == "none":
        return None
    if response == "exit":
        os._exit(3)
    if response == "np32":  # a numpy scalar: a number (the worker takes its Python value)
        import numpy as np

        return np.float32(0.5)
    if response == "array":  # not a scalar: not a number
        import numpy as np

        return np.zeros(3)
    if response == "alloc":  # 8 GiB of address space (calloc: untouched pages, no real memory), beyond reward.memory_mb
        return float(len(bytes(8 << 30)))
    return 1.0 if response.strip() == ground_truth else 0.0


def by_truth(response: str, ground_truth: str):
    """In a real run: raises when the ground truth is even, hangs when it ends in 5."""
    if int(ground_truth) % 2 == 0:
        raise KeyError("reward bug")
    if ground_truth.endswith("5"):
        time.sleep(3600)
    return 1.0 if ground_truth in response else 0.0
