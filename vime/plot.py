"""`vime plot RUN_DIR`: PNG curves of mismatch and reward from metrics.jsonl."""
from __future__ import annotations

from pathlib import Path

from .sinks import read_metrics


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    out = []
    panels = [("mismatch_count", "tokens whose float32 logprobs differ"), ("max_abs_diff", "max |rollout - train| logprob"),
              ("reward_mean", "mean reward"), ("time_step", "seconds per step")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        # an uncompared step (null) is a gap in the curve, not a zero
        ax.plot(steps, [float("nan") if r.get(key) is None else r[key] for r in rows], marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    path = Path(run_dir) / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    out.append(path)
    return out
