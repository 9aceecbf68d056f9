"""τ against trained-on tokens: the same recipe trained on nested subsets of one run's captured data.

    python bench/scaling_curve.py --run runs/smollm2-135m --recipe recipes/smollm2-135m.yaml \
        --prompts 150,400 [--out docs/img/smollm2-135m-scaling.png] [key.sub=value ...]

`--run` is a finished recipe run: its captured shards (DIR/capture) are shared, hard-linked, with every
subset run, so a point costs its training and eval only, never a new regeneration (the capture cache is
keyed by the regeneration settings, which the subsets keep). Each subset takes `--max-samples N` prompts
(the recipe's seeded subset) with everything else equal, epochs included. The full run is the last
point. Prints the table (trained-on tokens = loss tokens of the train split, τ chain and tree, val
acc_0, wall) and writes the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def point(summary: dict) -> dict:
    ev, data = summary["eval"], summary["data"]["train"]
    shapes = [k for k in ev if k.count(",") == 2]
    train = summary["train"]
    return {"prompts": data["rows"], "trained_on_tokens": data["loss_tokens"], "tokens": data["tokens"],
            "tau_chain": ev[shapes[0]]["tau"], "tau_tree": ev[shapes[1]]["tau"] if len(shapes) > 1 else None,
            "acc_0": train.get("val_acc_0"), "train_wall_s": train.get("wall_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a finished recipe run with captured features")
    p.add_argument("--recipe", required=True)
    p.add_argument("--prompts", required=True, help="comma-separated prompt counts of the smaller points")
    p.add_argument("--out", default="docs/img/smollm2-135m-scaling.png")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    run = Path(args.run)
    points = []
    for n in [int(x) for x in args.prompts.split(",")]:
        sub = run.parent / f"{run.name}-scale-{n}"
        if not (sub / "summary.json").exists():
            shutil.rmtree(sub / "capture", ignore_errors=True)
            sub.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-al", str(run / "capture"), str(sub / "capture")], check=True)
            cmd = [sys.executable, str(REPO / "train/train_eagle3.py"), "--recipe", args.recipe, "--output-dir",
                   str(sub), "--max-samples", str(n), *args.overrides]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "WANDB_MODE": "offline"})
        points.append(point(json.loads((sub / "summary.json").read_text())))
    points.append(point(json.loads((run / "summary.json").read_text())))
    print("| prompts | trained-on tokens | all tokens | τ chain | τ tree | val acc_0 | train wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for q in points:
        print(f"| {q['prompts']} | {q['trained_on_tokens']:,} | {q['tokens']:,} | {q['tau_chain']:.2f} | "
              f"{q['tau_tree'] or float('nan'):.2f} | {q['acc_0'] or float('nan'):.3f} | {q['train_wall_s']} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [q["trained_on_tokens"] for q in points]
    ax.plot(x, [q["tau_chain"] for q in points], "o-", label="chain (3, 1, 4)")
    if all(q["tau_tree"] for q in points):
        ax.plot(x, [q["tau_tree"] for q in points], "s-", label="tree (5, 8, 32)")
    ax.set_xscale("log")
    ax.set_xlabel("trained-on tokens (unique, train split)")
    ax.set_ylabel("τ (tokens per target forward, T = 0)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    (Path(args.out).with_suffix(".json")).write_text(json.dumps(points, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
