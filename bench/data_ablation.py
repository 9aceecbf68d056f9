"""What each source of data adds, at equal cost: greedy answers only / + sampled answers / + target-written
prompts, each arm the same number of regenerated answers (the cost of the regenerate and train stages is
linear in them), each run from an empty directory through the whole pipeline.

    python bench/data_ablation.py --recipe recipes/smollm2-135m.yaml --answers 240 --out runs/ablation \
        [key.sub=value ...]

Arms, with A = --answers:
- greedy:    A built-in prompts, the greedy answer of each (the recipe's default);
- samples:   A/3 prompts, each with its greedy answer and 2 sampled at T = 0.7 (regen.samples_per_prompt);
- synthetic: A/2 built-in prompts plus A/2 the target writes itself (data.synthetic_prompts), greedy.
Validation is the same fixed set of built-in prompts and greedy answers in every arm. Prints the table
(walls are measured: writing prompts, regenerate+capture, train, and the whole pipeline) and writes
OUT/ablation.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recipe_runs import row, run_recipe


def arms(answers: int) -> dict[str, list[str]]:
    third, half = answers // 3, answers // 2
    return {
        "greedy only": ["--max-samples", str(answers)],
        "+ samples (1 greedy + 2 at T 0.7)": ["--max-samples", str(third), "regen.samples_per_prompt=2",
                                              "regen.include_greedy=true", "regen.temperature=0.7"],
        "+ synthetic prompts (half)": ["--max-samples", str(answers - half), f"data.synthetic_prompts={half}"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--answers", type=int, default=240, help="regenerated train answers per arm")
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every arm")
    args = p.parse_args()
    results = {}
    for i, (name, extra) in enumerate(arms(args.answers).items()):
        out = Path(args.out) / f"arm{i}"
        run_recipe(args.recipe, out, [*extra, *args.overrides])
        results[name] = row(out)
    print("| arm | answers | trained-on tokens | writing prompts s | regenerate s | train s | pipeline s | "
          "val acc_0, acc_1, acc_2 | τ chain | τ tree |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, q in results.items():
        acc = ", ".join(f"{a:.3f}" for a in q["acc"][:3] if a is not None)
        print(f"| {name} | {q['rows']} | {q['trained_on_tokens']:,} | {q['synthetic_wall_s']:.0f} | "
              f"{q['regen_wall_s']:.0f} | {q['train_wall_s']:.0f} | {q['pipeline_wall_s']} | {acc} | "
              f"{q['tau_chain']:.2f} | {q['tau_tree'] or float('nan'):.2f} |")
    (Path(args.out) / "ablation.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
