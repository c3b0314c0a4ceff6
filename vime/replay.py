"""`vime replay RUN_DIR --step N [overrides]`: re-score a persisted batch under any op combination.

What this module decides: what a replay needs and what it reports. A run directory holds
everything: the step's records (tokens, rollout logprobs, the weight version that generated
them: records/step_N.parquet), the weights of that version (vime/weights.py: `weights/` with
run.save_weights=true, a checkpoint, or the base model for version 0) and the run's config
(provenance.json). The training engine (Megatron-core on rlkernel, as in the run) is rebuilt
from those weights at that version and re-scores the batch under the run's trainer policy
with the overrides applied; the result goes through the same comparability gate and the
same bitwise comparison as the run's step. With no overrides the numbers are the run's own
(the replay is exact); with overrides they answer "what if the trainer ran op X this way".
The last stdout line is one JSON object.

Overrides: `OP=CHOICE` (the trainer's op), `rlkernel.mode=strict|native`,
`rlkernel.ops.OP=CHOICE` or `rlkernel.trainer_ops.OP=CHOICE`; CHOICE is strict, native or an
implementation name (cpu, reference).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import rlkernel as rk

from .metrics import compare_logprobs, not_compared
from .records import read_records


def run_config(run_dir: Path) -> dict:
    """The run's resolved config (plain dict) from provenance.json."""
    prov = Path(run_dir) / "provenance.json"
    if not prov.exists():
        raise FileNotFoundError(f"{run_dir} is not a vime run directory (no provenance.json)")
    return json.loads(prov.read_text())["config"]


def side_policy(config: dict, side: str) -> tuple[str, dict]:
    """(mode, per-op choices) one engine ran with, from a run's plain config."""
    rl = config.get("rlkernel", {})
    ops = {k: v for k, v in (rl.get("ops") or {}).items() if v}
    ops.update({k: v for k, v in (rl.get(f"{side}_ops") or {}).items() if v})
    return rl.get("mode", "strict"), ops


def run_row_segments(run_dir: Path) -> int:
    """The canonical K-segment count both engines of a run used: what its trainer reported (provenance; the controller
    checked the engine's against it), else its config's number (rlkernel.row_segments=auto resolved by today's rule,
    vime.config.auto_row_segments), else the default of runs before the key (4)."""
    from rlkernel.models import ROW_SEGMENTS

    from .config import auto_row_segments

    prov = json.loads((Path(run_dir) / "provenance.json").read_text())
    ran = (prov.get("trainer") or {}).get("row_segments")
    if ran is not None:
        return int(ran)
    config = prov["config"]
    value = (config.get("rlkernel") or {}).get("row_segments", ROW_SEGMENTS)
    if value == "auto":
        return auto_row_segments(**{f"{side}.tp": int((config.get(side) or {}).get("tp", 1)) for side in ("trainer", "rollout")})
    return int(value)


def apply_overrides(mode: str, ops: dict, overrides: list[str], side: str) -> tuple[str, dict]:
    """Apply `OP=C`, `rlkernel.mode=M`, `rlkernel.ops.OP=C`, `rlkernel.<side>_ops.OP=C` to one side's policy."""
    ops = dict(ops)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise SystemExit(f"override {item!r}: expected KEY=VALUE (e.g. attention=native)")
        if key == "rlkernel.mode":
            mode = value
            continue
        for prefix in ("rlkernel.ops.", f"rlkernel.{side}_ops.", f"{side}.", ""):
            if key.startswith(prefix) and key[len(prefix):] in rk.OPS:
                ops[key[len(prefix):]] = value
                break
        else:
            other = "rollout" if side == "trainer" else "trainer"
            if key.startswith((f"{other}.", f"rlkernel.{other}_ops.")):
                raise SystemExit(f"override {item!r}: `vime replay` re-scores the {side} side only — the {other}'s logprobs are the "
                                 f"recorded ones. To re-run the {other} side too, use `vime diagnose RUN_DIR --step N {item}`")
            raise SystemExit(f"override {item!r}: unknown key (ops: {', '.join(rk.OPS)})")
    rk.ExecutionPolicy(mode=mode, ops=ops)  # validates mode and op names
    return mode, ops


def run_threads(config: dict, side: str) -> int | None:
    """The torch threads a run's engine ran with, from its plain config: Ray actors run at 1 thread (num_cpus=1), the
    trainer at trainer.threads when set; in-process runs at trainer.threads (None: the process default)."""
    t = config["trainer"].get("threads")
    if config["run"].get("executor") == "ray":
        return t if side == "trainer" and t else 1
    return t


def step_records(run_dir: Path, step: int):
    path = Path(run_dir) / "records" / f"step_{step:06d}.parquet"
    if not path.exists():
        have = sorted(p.stem for p in (Path(run_dir) / "records").glob("step_*.parquet"))
        raise FileNotFoundError(f"no records of step {step} in {run_dir} (have {have[:3]}...{have[-3:]})")
    records = read_records(path)
    versions = {v for r in records for v in r.weight_versions}
    if len(versions) != 1:
        raise ValueError(f"step {step}: records carry weight versions {sorted(versions)}; a replay needs one")
    return records, versions.pop()


def replay(run_dir: Path, step: int, overrides: list[str], threads: int | None = None) -> dict:
    from .batch import TrainBatch
    from .gate import comparability
    from .trainer import MegatronTrainer, TrainerConfig
    from .weights import version_checkpoint

    run_dir = Path(run_dir)
    config = run_config(run_dir)
    records, version = step_records(run_dir, step)
    mode, ops = apply_overrides(*side_policy(config, "trainer"), overrides, "trainer")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = version_checkpoint(run_dir, version, Path(tmp) / "hf")
        trainer = MegatronTrainer(TrainerConfig(mode=mode, ops=ops, dtype=config["model"]["dtype"], seed=config["run"]["seed"],
                                                threads=threads or run_threads(config, "trainer"),
                                                row_segments=run_row_segments(run_dir)))
        try:
            trainer.load_hf(ckpt)
            trainer.weight_version = version  # the weights loaded are that version's
            batch = TrainBatch.from_records(records)
            scored = trainer.score_with_digest(batch)
            vocab = trainer.model.output_layer.vocab_size
            prov = trainer.take_provenance()
        finally:
            trainer.close()
    cmp = comparability(records, scored.digest, scored.weight_version, version, vocab)
    stats = compare_logprobs([r.rollout_logprobs for r in records], scored.logprobs) if cmp["comparable"] else not_compared()
    recorded = _recorded(run_dir, step)
    replayed = _contract_ids(prov)
    ran = _run_contracts(run_dir, step)
    return {"run_dir": str(run_dir), "step": step, "weight_version": version, "trainer": {"mode": mode, "ops": ops},
            "rollout": dict(zip(("mode", "ops"), side_policy(config, "rollout"))), **stats,
            "comparable": cmp["comparable"], "not_comparable_reasons": cmp["reasons"],
            "impls": {op: sorted({e["impl"] for e in v}) for op, v in prov.items()},
            # the ops whose trainer contract differs from the one the run's trainer recorded at this step (an override,
            # or a contract version changed since the run: e.g. the GPU attention's v1 -> v2 split size, session 42);
            # None where the run kept no per-step provenance
            "contracts_differ_from_run": None if ran is None else {
                op: {"run": ran[op], "replay": ids} for op, ids in replayed.items() if op in ran and ran[op] != ids},
            "recorded": {k: recorded.get(k) for k in ("mismatch_count", "max_abs_diff", "compared_tokens")} if recorded else None}


def _contract_ids(prov: dict) -> dict:
    """{op: sorted contract ids} of an engine's provenance ({op: [call entries]})."""
    return {op: sorted({e["contract_id"] for e in v}) for op, v in prov.items()}


def _run_contracts(run_dir: Path, step: int) -> dict | None:
    """The contract ids the run's trainer recorded for `step` (provenance/step_N.json), or None."""
    path = run_dir / "provenance" / f"step_{step:06d}.json"
    if not path.exists():
        return None
    return _contract_ids(json.loads(path.read_text()).get("trainer") or {})


def _recorded(run_dir: Path, step: int) -> dict | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.strip() and json.loads(line)["step"] == step:
            return json.loads(line)
    return None


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="a vime run directory (records/, provenance.json, weights/ or checkpoints/)")
    p.add_argument("--step", type=int, required=True, help="the step whose batch to re-score")
    p.add_argument("--threads", type=int, default=None, help="trainer threads (default: what the run's trainer ran with — 1 in a Ray actor "
                   "unless trainer.threads — else this process's)")
    p.add_argument("overrides", nargs="*", help="trainer op choices: OP=strict|native|<impl>, rlkernel.mode=..., rlkernel.trainer_ops.OP=...")


def main(args) -> int:
    report = replay(Path(args.run_dir), args.step, args.overrides, args.threads)
    sys.stdout.flush()
    print(json.dumps(report))
    return 0
