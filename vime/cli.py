"""`vime` command line: one entry point, one subcommand per user task.

`vime train --config-name NAME [overrides]` runs a recipe (what `make run` calls
with grpo_tiny), `vime parity` checks rollout-vs-training logprobs on a model,
`vime plot RUN_DIR` draws a run's curves, `vime selfcheck` shows the strict
contract on this machine.
"""
from __future__ import annotations

import argparse
import json

def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    report = run_selfcheck(rows=args.rows)
    print(json.dumps(report))
    return 0 if report["strict_mismatches"] == 0 else 1


def _train(args) -> int:
    from .config import load_config
    from .controller import train
    from .preflight import check_resources

    cfg, plain = load_config(args.config_name, args.overrides)
    check_resources(cfg)
    run_dir = train(cfg, plain)
    print(json.dumps({"run_dir": str(run_dir), "metrics": str(run_dir / "metrics.jsonl")}))
    return 0


def _plot(args) -> int:
    from .plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vime", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn, help_ in (("selfcheck", _selfcheck, "strict vs native bitwise batch-invariance check of every rlkernel op"),):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--rows", type=int, default=64, help="largest batch size the check places a row in")
        p.set_defaults(fn=fn)
    from . import parity

    p = sub.add_parser("parity", help="generate with vLLM, re-score with a trainer-side scorer, compare logprobs bitwise")
    parity.add_arguments(p)
    p.set_defaults(fn=parity.main)
    p = sub.add_parser("train", help="run a GRPO recipe: vime train --config-name NAME [key=value ...]")
    p.add_argument("--config-name", default="grpo_tiny", help="recipe in recipes/ (without .yaml)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rlkernel.mode=native trainer.total_steps=5")
    p.set_defaults(fn=_train)
    p = sub.add_parser("plot", help="write PNG curves of a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.set_defaults(fn=_plot)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
