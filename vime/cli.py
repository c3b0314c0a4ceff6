"""`vime` command line: one entry point, one subcommand per user task.

`vime train --config-name NAME [overrides]` runs a recipe (what `make run` calls
with grpo_tiny), `vime parity` checks rollout-vs-training logprobs on a model,
`vime plot RUN_DIR [RUN_DIR ...]` draws a run's curves (or overlays arms), `vime selfcheck`
shows the strict contract on this machine. From a mismatch to its cause: `vime doctor`
(before a run: predicted mismatch, per op), `vime replay RUN_DIR --step N` (re-score a saved
step under any op combination), `vime diagnose RUN_DIR --step N` (both engines op by op).
"""
from __future__ import annotations

import argparse
import json
import sys

def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    report = run_selfcheck(rows=args.rows)
    print(json.dumps(report))
    return 0 if report["strict_mismatches"] == 0 else 1


def _train(args) -> int:
    from .config import load_config
    from .controller import train
    from .preflight import check_resources

    from .sinks import summarize

    from .config import ConfigError
    from .preflight import PreflightError

    bare = [o for o in args.overrides if "=" not in o]
    if bare:  # `vime train grpo_qwen3_8b`: a recipe named without --config-name reads as an override
        print(f"vime: {bare[0]!r} is not a key=value override; a recipe is named with --config-name {bare[0]}", file=sys.stderr)
        return 2
    try:
        cfg, plain = load_config(args.config_name, args.overrides)
        check_resources(cfg)
    except (ConfigError, PreflightError) as e:  # the message names the key and the fix: one line, no traceback
        print(f"vime: {e}", file=sys.stderr)
        return 2
    try:
        run_dir = train(cfg, plain)
    except ConfigError as e:  # found while preparing (a model or data file that is not what the config asks for)
        print(f"vime: {e}", file=sys.stderr)
        return 2
    summary = summarize(run_dir)
    print(json.dumps({"run_dir": str(run_dir), "metrics": str(run_dir / "metrics.jsonl"), "summary": summary}))
    broken = sorted(set(summary["problem_steps"]) & STRICT_PROBLEMS) if cfg.rlkernel.mode == "strict" else []
    if broken and cfg.run.fail_on_strict_violation:
        print(f"vime: the strict run had {', '.join(broken)} problems (summary above); exit 3 (run.fail_on_strict_violation)",
              file=sys.stderr)
        return 3
    return 0


# what makes a strict run not what it claims (sinks.alarms' kinds): run.fail_on_strict_violation exits 3 on any
STRICT_PROBLEMS = {"strict_ok", "contracts", "comparable", "mismatch"}


def _plot(args) -> int:
    from .plot import plot_run, plot_runs

    if len(args.run_dirs) == 1 and not args.out:
        paths = plot_run(args.run_dirs[0])
    else:
        paths = plot_runs(args.run_dirs, args.out or "compare.png")
    for path in paths:
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
    from . import doctor

    p = sub.add_parser("doctor", help="before a run: per-op contracts and implementations of both engines, ΔC, golden bits, predicted mismatch")
    doctor.add_arguments(p)
    p.set_defaults(fn=doctor.main)
    from . import replay

    p = sub.add_parser("replay", help="re-score a run's step with the weights of its version under any op combination")
    replay.add_arguments(p)
    p.set_defaults(fn=replay.main)
    from . import diagnose

    p = sub.add_parser("diagnose", help="both engines on frozen tokens, op by op: name the first op whose outputs differ, and why")
    diagnose.add_arguments(p)
    p.set_defaults(fn=diagnose.main)
    p = sub.add_parser("plot", help="PNG curves of a run's metrics.jsonl, or of several runs overlaid arm by arm")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="with several runs: the PNG to write (default ./compare.png)")
    p.set_defaults(fn=_plot)
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (`vime replay RUN --step N attention=native`): argparse leaves those over
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
