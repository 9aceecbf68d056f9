"""The training curves as a PNG beside metrics.jsonl, readable without wandb or a notebook."""

from __future__ import annotations

import json
from pathlib import Path


def plot_acc(metrics_path: Path, out_png: Path) -> None:
    """acc_k per step (training and validation) as one PNG: the curve that tells whether to train longer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, split in zip(axes, ("train", "val")):
        pts = [r for r in rows if r.get("split") == split]
        k, win = 0, 20 if split == "train" else 1  # per-step training batches are small: smooth them
        while pts and f"acc_{k}" in pts[0]:
            ys = [r[f"acc_{k}"] for r in pts]
            ys = [sum(ys[max(0, i - win + 1):i + 1]) / len(ys[max(0, i - win + 1):i + 1]) for i in range(len(ys))]
            ax.plot([r["step"] for r in pts], ys, label=f"acc_{k}")
            k += 1
        ax.set_title(f"{split}: draft top-1 accuracy per TTT step" + (f" ({win}-step mean)" if win > 1 else ""))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if k:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
