"""Distill an EAGLE-3 head: run every stage the recipe needs that is not done yet, train, export, evaluate.

    accelerate launch train/train_eagle3.py --recipe recipes/smollm2-135m.yaml [key.sub=value ...]
        [--output-dir DIR] [--max-samples N] [--max-steps N] [--budget-minutes M] [--dry-run]

Stages (each cached under DIR, keyed by its inputs): prompts/data -> regenerate (target answers) ->
prepare (tokens + loss mask) -> vocab (d2t/t2d) -> [dump features, offline mode] -> train -> export
(DIR/export) -> eval (DIR/eval.json). Without `accelerate launch` it runs as one process. Data stages run
on rank 0 while the other ranks wait, except regeneration with capture (offline + engine), which every
rank does for its share of the rows; training and feature dumps are data-parallel. The stages are
declared in train/pipeline.py (`STAGES`); `--dry-run` prints the ones this recipe runs.
"""

from __future__ import annotations

import argparse
import sys

from tsengine.errors import run_main
from tsengine.train import recipe as recipes
from tsengine.train.pipeline import run


def main(argv: list[str] | None = None) -> int:
    from tsengine.train.threads import use_machine_cores  # first: before torch's thread pool sizes itself
    use_machine_cores()
    p = argparse.ArgumentParser(prog="train_eagle3.py", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True, help="YAML recipe (recipes/*.yaml)")
    p.add_argument("--output-dir", help="run directory (overrides output_dir); the head lands in DIR/export")
    p.add_argument("--max-samples", type=int, help="use at most N training rows (quick runs)")
    p.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    p.add_argument("--budget-minutes", type=float, help="size the data to end within M minutes, eval included "
                   "(overrides budget_minutes; data.max_samples then caps the planned rows)")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe, print its stages and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    args = p.parse_intermixed_args(argv)  # key=value overrides may sit between flags

    def body() -> None:
        extra = {"output_dir": args.output_dir, "data.max_samples": args.max_samples, "train.max_steps": args.max_steps,
                 "budget_minutes": args.budget_minutes}
        r = recipes.load(args.recipe, args.overrides, **extra)
        sized = any(o.split("=", 1)[0].strip() in ("eval.num_prompts", "eval.max_new_tokens") for o in args.overrides)
        run(r, dry_run=args.dry_run, user_sized=sized)

    return run_main("train_eagle3", body)


if __name__ == "__main__":
    sys.exit(main())
