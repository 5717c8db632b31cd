"""Training curves like the paper's figures: task reward, mean response length (with B), lambda."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_training_curves(metrics_path: str | Path, out_png: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    # the constraints beyond the mean: each multiplier and its constraint's measured value (a fourth panel)
    extra = sorted({k for r in rows for k in r if k.startswith(("laconic/lambda/", "laconic/mu_tail",
                                                                 "laconic/length_ratio/", "laconic/tail_share"))})
    fig, axes = plt.subplots(1, 4 if extra else 3, figsize=(17 if extra else 13, 3.6))
    axes[0].plot(steps, [r["task_reward"] for r in rows], color="tab:green")
    axes[0].set_title("task reward (accuracy)")
    axes[1].plot(steps, [r["mean_response_length"] for r in rows], color="tab:blue", label="mean length")
    axes[1].axhline(rows[0]["budget"], color="k", ls="--", lw=1, label="budget B")
    axes[1].set_title("mean response length (tokens)")
    axes[1].legend(loc="best", fontsize=8)
    axes[2].plot(steps, [r["lambda"] for r in rows], color="tab:red")
    axes[2].set_title("lambda")
    if extra:
        for k in extra:
            ys = [r.get(k) for r in rows]
            style = "--" if k.startswith(("laconic/length_ratio/", "laconic/tail_share")) else "-"
            axes[3].plot(steps, [float("nan") if y is None else y for y in ys], ls=style, label=k[len("laconic/"):])
        axes[3].set_title("constraints: multipliers (-), measured (--)")
        axes[3].legend(loc="best", fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
