"""Where per-step metrics go: metrics.jsonl, wandb (offline by default), the console.

What this module decides: the metric record's persistence. JSONL lines are
appended and flushed every step (nothing lost on a crash); wandb runs offline
under the run directory unless configured online; the console shows one
progress bar over steps with the numbers users watch. A step that was not
comparable has `mismatch_count: null` in the JSONL and `mismatch=n/a` on the bar;
wandb gets only numbers (nested counts flattened as `reward_failures/<reason>`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class MetricSinks:
    def __init__(self, run_dir: Path, cfg, config_dict: dict, total: int, start: int):
        from tqdm import tqdm

        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.wandb = None
        if cfg.logging.wandb and cfg.logging.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            # one experiment (recipe) = one wandb group, its arm a tag: the UI overlays the arms without hand work
            self.wandb = wandb.init(project=cfg.logging.project, name=f"{cfg.run.name}-{arm_name(config_dict)}", dir=str(run_dir),
                                    mode=cfg.logging.wandb_mode, config=config_dict, resume="allow", id=_run_id(run_dir),
                                    group=cfg.run.name, tags=arm_tags(config_dict))
        self._desc = f"{cfg.run.name} [{cfg.rlkernel.mode}]"
        self._strict = cfg.rlkernel.mode == "strict"
        self._warned: set[str] = set()
        self.bar = tqdm(total=total, initial=start, desc=self._desc, unit="step", disable=not cfg.logging.progress)

    def phase(self, name: str) -> None:
        """Show which phase of the step is running (rollout / score / update / sync)."""
        self.bar.set_description_str(f"{self._desc} | {name}")

    def log(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.wandb is not None:
            self.wandb.log(_numbers(metrics), step=metrics["step"])
        compile_s = metrics.get("time_compile")
        if compile_s is not None and compile_s >= COMPILE_NOTE_SECONDS:  # say why a (first) step took long
            self.bar.write(f"vime: step {metrics['step']} spent {compile_s:.0f} s of its {metrics['time_step']:.0f} s compiling "
                           "rlkernel's Triton kernels for this GPU (once per machine: Triton caches them; "
                           f"cache: {_triton_cache_dir()})", file=sys.stderr)
        for kind, line in alarms(metrics, self._strict):  # the first step of each kind says so under the bar
            if kind not in self._warned:
                self._warned.add(kind)
                self.bar.write(f"vime: step {metrics['step']}: {line} (later steps of this kind: metrics.jsonl and the run's "
                               f"summary; `vime doctor --run {self.run_dir}`)", file=sys.stderr)
        self.bar.set_postfix(postfix(metrics))
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


COMPILE_NOTE_SECONDS = 10.0  # a step whose trainer compiled kernels this long says so under the progress bar


def _triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels: Triton's own setting (`knobs.cache.dir`: TRITON_CACHE_DIR or its default)."""
    try:
        from triton import knobs
    except ImportError:  # only a CUDA run (which has Triton) reports compile time
        return os.environ.get("TRITON_CACHE_DIR", "Triton's default")
    return knobs.cache.dir


def arm_name(config: dict) -> str:
    """The experiment arm of a run's (plain) config: G<strict 1|native 0><rollout logprobs 1|0>, then any
    per-op overrides (`+rms_norm=native`, one-sided: `+trainer:rms_norm=native`)."""
    rl, algo = config.get("rlkernel", {}), config.get("algorithm", {})
    name = f"G{int(rl.get('mode', 'strict') == 'strict')}{int(bool(algo.get('use_rollout_logprobs', False)))}"
    for key, prefix in (("ops", ""), ("rollout_ops", "rollout:"), ("trainer_ops", "trainer:")):
        name += "".join(f"+{prefix}{op}={v}" for op, v in sorted((rl.get(key) or {}).items()) if v)
    return name


def arm_tags(config: dict) -> list[str]:
    """wandb tags: the arm (G00..G11), the mode, and each override."""
    name = arm_name(config)
    return [name.split("+")[0], config.get("rlkernel", {}).get("mode", "strict"), *name.split("+")[1:]]


def alarms(metrics: dict, strict: bool) -> list[tuple[str, str]]:
    """What a step's metric line says went wrong, as (kind, one line): a strict run that did not run strict, engines on
    different contracts, a step that could not be compared, rollout and training logprobs that differ in a strict run,
    samples whose reward failed."""
    out = []
    if metrics.get("strict_ok") is False:
        v = metrics.get("strict_violations") or []
        out.append(("strict_ok", f"not strict (strict_ok=false): {v[0] if v else '?'}" + (f" (+{len(v) - 1} more)" if len(v) > 1 else "")))
    if metrics.get("contracts_match") is False:
        out.append(("contracts", f"the engines ran different contracts for {', '.join(metrics.get('contracts_differ') or ['?'])}"))
    if metrics.get("comparable") is False:
        out.append(("comparable", f"not compared: {'; '.join(metrics.get('not_comparable_reasons') or ['?'])}"))
    if strict and metrics.get("mismatch_count"):
        out.append(("mismatch", f"{metrics['mismatch_count']} rollout logprobs differ from training's (max |diff| "
                                f"{metrics.get('max_abs_diff')})"))
    if (metrics.get("sample_status") or {}).get("aborted"):
        masked = bool(metrics.get("masked_samples"))  # algorithm.mask_truncated
        out.append(("aborted", f"{metrics['sample_status']['aborted']} sample(s) aborted by the engine ("
                               + ("not trained on: algorithm.mask_truncated" if masked else "trained on as far as they got")
                               + "; records: status 'aborted')"))
    failed = metrics.get("reward_failures") or {}
    if failed:
        out.append(("reward", f"{sum(failed.values())} sample(s) got reward 0 because their reward failed: {failed}"))
    return out


def summarize(run_dir: str | Path) -> dict:
    """A finished run in numbers (what `vime train` prints last): its steps and, per kind of `alarms`, the steps that
    had it."""
    rows = read_metrics(run_dir)
    strict = bool(rows) and rows[0].get("strict_ok") is not None
    steps: dict[str, list[int]] = {}
    for m in rows:
        for kind, _ in alarms(m, strict):
            steps.setdefault(kind, []).append(m["step"])
    return {"steps": len(rows), "mode": "strict" if strict else "native", "problem_steps": steps}


def postfix(metrics: dict) -> dict:
    """The progress bar's numbers; an uncompared step shows mismatch=n/a, never 0."""
    m = metrics["mismatch_count"]
    return {"reward": f"{metrics['reward_mean']:.2f}", "mismatch": "n/a" if m is None else m, "v": metrics["weight_version"]}


def _numbers(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in v.items() if isinstance(vv, (int, float, bool))})
        elif isinstance(v, (int, float, bool)):
            out[k] = v
    return out


def _run_id(run_dir: Path) -> str:
    f = run_dir / "wandb_id.txt"
    if f.exists():
        return f.read_text().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    f.write_text(rid)
    return rid


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl under {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
