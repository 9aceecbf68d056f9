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
import math
from pathlib import Path

from recipe_runs import link_capture, row, run_recipe


def log_fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·ln(x): the trend a scaling curve of this size can support, no more."""
    lx = [math.log(v) for v in x]
    mx, my = sum(lx) / len(lx), sum(y) / len(y)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, y)) / sum((u - mx) ** 2 for u in lx)
    return my - b * mx, b


def require_same_settings(full: Path, sub: Path) -> None:
    """A point may differ from the full run in its subset, the oracle check and logging (which measure
    nothing) and the budget (which sized the full run: the point's settings pin what it chose) only:
    otherwise the curve would mix recipes. Fields a run predates read as their defaults."""
    from tsengine.train.recipe import validate

    def settings(run: Path) -> dict:
        r = validate(json.loads((run / "summary.json").read_text())["recipe"]).model_dump()
        del r["output_dir"], r["data"]["max_samples"], r["eval"]["oracle_prompts"], r["budget_minutes"], r["log"]
        return r

    a, b = settings(full), settings(sub)
    if a != b:
        diff = sorted(f"{k}.{f}" if f else k for k in a
                      for f in (set(a[k]) | set(b[k]) if isinstance(a[k], dict) else [None])
                      if (a[k].get(f) != b[k].get(f) if f else a[k] != b[k]))
        raise SystemExit(f"{sub}: trained with other settings than {full}: {', '.join(diff)}")


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
            link_capture(run, sub)
        run_recipe(args.recipe, sub, ["--max-samples", str(n), *args.overrides])
        require_same_settings(run, sub)
        points.append(row(sub))
    points.append(row(run))
    print("| prompts | trained-on tokens | all tokens | τ chain | τ tree | val acc_0 | train wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for q in points:
        print(f"| {q['rows']} | {q['trained_on_tokens']:,} | {q['tokens']:,} | {q['tau_chain']:.2f} | "
              f"{q['tau_tree'] or float('nan'):.2f} | {q['acc'][0] or float('nan'):.3f} | {q['train_wall_s']} |")
    for name, goal in (("tau_chain", 3.0), ("tau_tree", 4.0)):
        if all(q[name] for q in points):
            a, b = log_fit([q["trained_on_tokens"] for q in points], [q[name] for q in points])
            need = math.exp((goal - a) / b) if b > 0 else float("inf")
            print(f"{name}: τ ≈ {a:.3f} + {b:.3f}·ln(tokens); τ {goal} at ~{need:,.0f} trained-on tokens "
                  f"({need / points[-1]['trained_on_tokens']:.0f}x the largest point) if the trend held")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [q["trained_on_tokens"] for q in points]
    ax.plot(x, [q["tau_chain"] for q in points], "o-", label=f"chain ({points[0]['shapes'][0]})")
    if all(q["tau_tree"] for q in points):
        ax.plot(x, [q["tau_tree"] for q in points], "s-", label=f"tree ({points[0]['shapes'][1]})")
    ax.set_xscale("log")
    ax.set_xlabel("trained-on tokens (assistant tokens, train split)")
    ax.set_ylabel("τ (tokens per target forward, T = 0)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    (Path(args.out).with_suffix(".json")).write_text(json.dumps(points, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
