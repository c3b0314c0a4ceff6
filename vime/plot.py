"""`vime plot RUN [RUN ...]`: PNG curves of one run, or several runs overlaid arm by arm.

What this module decides: the figures users compare arms with. One run: mismatch, max |Δ|,
reward and step time (curves.png in the run directory). Several runs (the G-arms of one
experiment, per-op ablations): one figure with a line per run, labelled by its arm
(`arm_name`: G<strict><rollout-logprobs>, plus one-sided or per-op overrides) — mismatch
count, max |Δ| on a log scale (0 cannot be drawn there: those steps sit on the floor line),
KL to the old policy and the clip fraction side by side; beside the PNG, a JSON of the lines
as drawn (read back from the figure's axes: label, x, y and the axis scale of each panel).
"""
from __future__ import annotations

import json
from pathlib import Path

from .sinks import arm_name, read_metrics

_FLOOR = 1e-12  # where max |Δ| = 0 is drawn on the log axis


def _series(rows, key):
    return [float("nan") if r.get(key) is None else r[key] for r in rows]  # an uncompared step is a gap, not a zero


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    panels = [("mismatch_count", "tokens whose float32 logprobs differ"), ("max_abs_diff", "max |rollout - train| logprob"),
              ("reward_mean", "mean reward"), ("time_step", "seconds per step")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(steps, _series(rows, key), marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    path = Path(run_dir) / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def run_arm(run_dir: str | Path) -> str:
    prov = Path(run_dir) / "provenance.json"
    return arm_name(json.loads(prov.read_text())["config"]) if prov.exists() else Path(run_dir).name


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> list[Path]:
    """Several runs on one figure, one line per run labelled `<arm> (<run dir name>)`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mismatch_count", "tokens whose float32 logprobs differ", "linear"),
              ("max_abs_diff", f"max |rollout - train| logprob (0 drawn at {_FLOOR:g})", "log"),
              ("approx_kl_old", "KL to the old policy", "linear"), ("clip_fraction", "clip fraction", "linear"),
              ("reward_mean", "mean reward", "linear")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for run in run_dirs:
        rows, label = read_metrics(run), f"{run_arm(run)} ({Path(run).name})"
        steps = [r["step"] for r in rows]
        for ax, (key, _, scale) in zip(axes, panels):
            ys = _series(rows, key)
            if scale == "log":
                ys = [max(y, _FLOOR) if y == y else y for y in ys]
            ax.plot(steps, ys, marker="o", ms=3, label=label)
    for ax, (_, title, scale) in zip(axes, panels):
        ax.set_yscale(scale)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    # what the figure holds, read back from its axes (a sidecar JSON: scripts and tests check the lines, not just a PNG)
    drawn = [{"key": key, "title": ax.get_title(), "yscale": ax.get_yscale(),
              "lines": [{"label": ln.get_label(), "x": [float(v) for v in ln.get_xdata()], "y": [float(v) for v in ln.get_ydata()]}
                        for ln in ax.get_lines()]} for ax, (key, _, _) in zip(axes, panels)]
    path.with_suffix(".json").write_text(json.dumps({"runs": [str(r) for r in run_dirs], "panels": drawn}, allow_nan=True))
    plt.close(fig)
    return [path]
