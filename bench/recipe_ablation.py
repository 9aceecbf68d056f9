"""The best recipe per token: one change at a time against the recipe, every arm trained on the same
regenerated answers and captured features (so the arms differ by the training recipe alone), each
through the whole pipeline and the same eval.

    python bench/recipe_ablation.py --recipe recipes/smollm2-135m.yaml --prompts 400 \
        --out runs/recipe-ablation [--arms NAME,NAME] [key.sub=value ...]

The first arm, "recipe", regenerates and captures; every later arm starts from a copy of its data/ and
a hard-linked copy of its capture/ (the regeneration's stage keys match, so those stages are skipped;
each arm's run.log shows no "generate" bar before training) and redoes vocab, head, training and eval. A rerun resumes:
finished arms are read back. Prints the table (Δ against "recipe") and writes OUT/ablation.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from recipe_runs import link_capture, row, run_recipe

# name -> the overrides that make the arm; each changes one thing from the embedded recipe
ARMS: dict[str, list[str]] = {
    "recipe": [],
    "aligned steps (GRIFFIN)": ["train.aligned_steps=true"],
    "lm_head from the target": ["head.lm_head_from_target=true"],
    "draft vocab 8k": ["vocab.draft_vocab_size=8192"],
    "TTT steps 3": ["train.ttt_steps=3"],
    "TTT steps 7": ["train.ttt_steps=7"],
    "lr 3e-4": ["train.lr=3e-4"],
    "batch tokens 2048": ["train.batch_tokens=2048"],
    "fc init random": ["head.fc_init=random"],
    "step weight 1.0 (no decay)": ["train.step_weight_decay=1.0"],
    "draft vocab 16k": ["vocab.draft_vocab_size=16384"],
    "lr 3e-3": ["train.lr=3e-3"],
    "epochs 6": ["train.epochs=6"],
    "TTT steps 3 + lm_head from the target": ["train.ttt_steps=3", "head.lm_head_from_target=true"],
    # the training passes of 3 answers a prompt at 3 epochs, from one answer: epochs against answers
    "epochs 9": ["train.epochs=9"],
}


def seed_from(base: Path, out: Path) -> None:
    """`out` starts with `base`'s regenerated data (copied: small, and rewritten in place by some stages)
    and its captured features (hard links: gigabytes, and only ever replaced whole by their stage)."""
    if out.exists():
        return
    tmp = out.with_name(out.name + ".seed")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(base / "data", tmp / "data")
    link_capture(base, tmp)
    tmp.rename(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--prompts", type=int, default=400, help="built-in train prompts (greedy answers), every arm")
    p.add_argument("--out", default="runs/recipe-ablation")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names (default: all)")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every arm")
    args = p.parse_args()
    names = ["recipe"] + [n for n in args.arms.split(",") if n and n != "recipe"]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; allowed: {list(ARMS)}")
    root = Path(args.out)
    common = ["--max-samples", str(args.prompts), "features.mode=offline", *args.overrides]
    results = {}
    for i, name in enumerate(names):
        out = root / f"arm{list(ARMS).index(name):02d}"
        if i:
            seed_from(root / "arm00", out)
        run_recipe(args.recipe, out, [*common, *ARMS[name]])
        results[name] = {"overrides": ARMS[name], **row(out)}
        (root / "ablation.json").write_text(json.dumps(results, indent=1))
        print(table(results), flush=True)


def table(results: dict) -> str:
    base = results["recipe"]
    lines = ["| arm | trained-on tokens | train s | eval s | val acc_0, acc_1, acc_2 | τ chain (Δ) | "
             "τ tree (Δ) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, q in results.items():
        acc = ", ".join(f"{a:.3f}" for a in q["acc"][:3] if a is not None)
        d_chain, d_tree = q["tau_chain"] - base["tau_chain"], (q["tau_tree"] or 0) - (base["tau_tree"] or 0)
        lines.append(f"| {name} | {q['trained_on_tokens']:,} | {q['train_wall_s']:.0f} | "
                     f"{q['eval_wall_s'] or 0:.0f} | {acc} | {q['tau_chain']:.3f} ({d_chain:+.3f}) | "
                     f"{q['tau_tree'] or float('nan'):.3f} ({d_tree:+.3f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
