"""`vime` command line: one entry point, one subcommand per user task.

What exists today: `vime run` (what `make run` calls) and `vime selfcheck`. The
GRPO loop (`vime train`) and `vime parity` arrive with their issues; until then
`vime run` says so and runs the rlkernel self-check, so the command always does
something a user can read.
"""
from __future__ import annotations

import argparse
import json
import sys

NOT_BUILT = {
    "train": "the GRPO loop (rollout -> buffer -> scoring -> update -> weight sync) is not built yet",
}


def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    report = run_selfcheck(rows=args.rows)
    print(json.dumps(report))
    return 0 if report["strict_mismatches"] == 0 else 1


def _run(args) -> int:
    print("vime: " + NOT_BUILT["train"] + "; `make run` runs the rlkernel self-check meanwhile.", file=sys.stderr)
    return _selfcheck(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vime", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn, help_ in (("run", _run, "the default job (what `make run` runs)"),
                            ("selfcheck", _selfcheck, "strict vs native bitwise batch-invariance check of every rlkernel op")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--rows", type=int, default=64, help="largest batch size the check places a row in")
        p.set_defaults(fn=fn)
    from . import parity

    p = sub.add_parser("parity", help="generate with vLLM, re-score with a trainer-side scorer, compare logprobs bitwise")
    parity.add_arguments(p)
    p.set_defaults(fn=parity.main)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
