"""Synthetic verifiable tasks, generated locally (no dataset hub).

`addition`: "a+b=" with single digits, answer a+b — small enough that a tiny
character-level model learns it in minutes (the `grpo_tiny` recipe), and
graded by math-verify like any math set. `word_problems`: short arithmetic
word problems in gsm8k layout ("#### answer") for real small LMs (SmolLM2).
Files are written in the dapo-math-17k or gsm8k layout that `load_prompts` reads.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
THINGS = ["apples", "books", "coins", "marbles", "pencils", "stamps"]


def addition_rows(n: int, seed: int = 0, max_digit: int = 9) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_digit), rng.randint(0, max_digit)
        rows.append({
            "data_source": "vime/addition",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        })
    return rows


def word_problem_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 20), rng.randint(1, 9)
        if rng.random() < 0.5:
            q, ans = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
        else:
            q, ans = f"{name} has {a + b} {thing} and gives away {b}. How many {thing} are left?", a
        rows.append({"question": q, "answer": f"{name} ends with {ans} {thing}.\n#### {ans}"})
    return rows


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as .jsonl or .parquet (by suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise ValueError(f"write .jsonl or .parquet, not {path.suffix!r}")
    return path
