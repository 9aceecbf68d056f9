"""What the data benchmarks (scaling_curve.py, data_ablation.py) share: run the training pipeline as a user
does, in its own process and output directory, and read one row of results back from its summary.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def link_capture(run: Path, out: Path) -> None:
    """`out`/capture as hard links of `run`'s captured features: gigabytes shared, never copied (the capture
    stage only ever replaces its files whole, so a later run cannot change another's)."""
    shutil.rmtree(out / "capture", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run / "capture", out / "capture", copy_function=os.link)


def run_recipe(recipe: str, out: Path, args: list[str]) -> float:
    """Runs the whole pipeline into `out` unless it already finished there (a rerun of the benchmark
    resumes); returns the wall seconds of this call (0 when it was already done)."""
    if (out / "summary.json").exists():
        return 0.0
    out.mkdir(parents=True, exist_ok=True)
    # the benchmarks compare fixed sizes: the recipe's budget (which would size the data itself) is off
    cmd = [sys.executable, str(REPO / "train/train_eagle3.py"), "--recipe", recipe, "--output-dir", str(out),
           "budget_minutes=null", *args]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(out / "run.log", "a") as log:  # the pipeline's own progress, kept beside its results
        subprocess.run(cmd, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "WANDB_MODE": "offline"})
    wall = time.perf_counter() - t0
    (out / "bench_wall.json").write_text(json.dumps({"wall_s": round(wall, 1)}))
    return wall


def row(out: Path) -> dict:
    """One result row: data sizes, stage walls, validation acc_k and τ per evaluated shape."""
    summary = json.loads((out / "summary.json").read_text())
    ev, data, train = summary["eval"], summary["data"]["train"], summary["train"]
    shapes = [k for k in ev if k.count(",") == 2]
    regen = summary.get("regen", {})
    synthetic = out / "data" / "prompts" / "synthetic.report.json"
    bench = out / "bench_wall.json"
    return {"rows": data["rows"], "trained_on_tokens": data["loss_tokens"], "tokens": data["tokens"],
            "tau_chain": ev[shapes[0]]["tau"], "tau_tree": ev[shapes[1]]["tau"] if len(shapes) > 1 else None,
            "shapes": shapes,
            "acc": [train.get(f"val_acc_{k}") for k in range(summary["recipe"]["train"]["ttt_steps"])],
            "train_wall_s": train.get("wall_s"), "eval_wall_s": ev.get("wall_s"),
            "regen_wall_s": sum(v["wall_s"] for v in regen.values()) if regen else None,
            "synthetic_wall_s": json.loads(synthetic.read_text())["wall_s"] if synthetic.exists() else 0.0,
            "pipeline_wall_s": json.loads(bench.read_text())["wall_s"] if bench.exists() else None,
            "bytes_per_token": summary.get("feature_bytes_per_token")}
