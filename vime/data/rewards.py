"""Verifiable rewards: math answers checked by math-verify.

What this module decides: how a response is turned into a reward. The answer
is what follows the last 'Answer:' marker, or a \\boxed{...}, or else the whole
response; math-verify decides equivalence with the ground truth (numbers,
fractions, LaTeX). 1.0 for correct, 0.0 otherwise. math-verify does not raise on
hostile text (its parser returns no match); anything that does raise is not
hidden here: the reward worker (vime.data.reward_worker) runs this function in a
child process, with a timeout, and counts failures per reason.
"""
from __future__ import annotations

import re

from math_verify import parse, verify

_ANSWER = re.compile(r"Answer:[ \t]*([^\n]*)", re.I)


def extract_answer(response: str) -> str:
    parts = _ANSWER.findall(response)
    if parts:
        return parts[-1].strip()
    return response.strip()


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 if the response's answer is mathematically equal to ground_truth, else 0.0."""
    answer = extract_answer(response)
    if not answer:
        return 0.0
    gold = parse(f"${ground_truth}$")
    pred = parse(answer if "\\boxed" in answer else f"${answer}$")
    return 1.0 if pred and verify(gold, pred) else 0.0
