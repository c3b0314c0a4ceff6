"""Reward functions that misbehave on purpose, for the reward-worker tests (imported by the worker process)."""
import os
import time


def by_text(response: str, ground_truth: str):
    """The response text picks the failure: raise, hang, nan, none, exit; otherwise exact match."""
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
    return 1.0 if response.strip() == ground_truth else 0.0


def by_truth(response: str, ground_truth: str):
    """In a real run: raises when the ground truth is even, hangs when it ends in 5."""
    if int(ground_truth) % 2 == 0:
        raise KeyError("reward bug")
    if ground_truth.endswith("5"):
        time.sleep(3600)
    return 1.0 if ground_truth in response else 0.0
