#!/usr/bin/env python3
"""Generate a synthetic verifiable prompt set (dapo or gsm8k layout) as .parquet or .jsonl."""
import argparse

from vime.data.synthetic import addition_rows, word_problem_rows, write_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", help="output file (.parquet or .jsonl)")
    ap.add_argument("--task", choices=["addition", "word_problems"], default="addition")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows = addition_rows(a.n, a.seed) if a.task == "addition" else word_problem_rows(a.n, a.seed)
    print(write_rows(rows, a.out))


if __name__ == "__main__":
    main()
