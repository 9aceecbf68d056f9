"""`make demo`: the main job on the embedded default target.

For now (the engine and the trainer land in later issues) the main job is the reference speculative
generator on SmolLM2-135M-Instruct with an untrained EAGLE-3 head: it prints the text, the tokens
accepted per verify step, and whether the output matched plain greedy decoding (it must).
"""

from __future__ import annotations

import sys

from tsengine.errors import UserError

PROMPT = "Write a Python function that checks whether a number is prime."


def main() -> int:
    from tsengine.cli import main as cli
    from tsengine.targets import cache_root, pull

    target = pull("smollm2-135m")
    print(f"target: {target}")
    head = cache_root() / "heads" / "smollm2-135m-untrained"
    if not (head / "model.safetensors").exists():
        if cli(["head", "init", "--target", str(target), "--out", str(head), "--seed", "0"]):
            return 2
    print(f"draft head (untrained, random weights): {head}\n")
    from infer.generate import main as generate

    rc = 0
    for label, extra in (("chain: 3 steps, 4 tokens", []),
                         ("tree: 4 steps, top-4, 16 nodes", ["--topk", "4", "--steps", "4", "--num-draft-tokens", "16"])):
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
