"""τ and wall time of the reference speculative generator vs plain greedy (both full recompute).

The reference is the oracle, slow by design: this measures acceptance (τ) and the cost of drafting for a
given head, not engine speed. Ratios come from one run, side by side.

    python bench/reference_tau.py --target smollm2-135m --draft DIR [--prompts 3 --max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for writing clear emails.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet.",
]
SHAPES = [(3, 1, 4), (4, 4, 16), (6, 8, 32)]


def main() -> None:
    from tsengine.eagle3.format import load_head
    from tsengine.infer.reference import ReferenceSpeculator, SpecShape, compare_to_greedy, greedy_generate
    from tsengine.targets import encode_prompt, eos_ids, load_target

    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()
    model, tok = load_target(args.target)
    head = load_head(args.draft, target=model.config, embeddings=model.get_input_embeddings().weight)
    stop = eos_ids(model, tok)
    prompts = [encode_prompt(tok, t) for t in PROMPTS[: args.prompts]]
    t0 = time.perf_counter()
    greedy = [greedy_generate(model, pr, args.max_new_tokens, stop) for pr in prompts]
    t_plain = time.perf_counter() - t0
    n_plain = sum(map(len, greedy))
    print(f"plain greedy (full recompute): {n_plain / t_plain:.1f} tok/s")
    print(f"{'shape (S,K,N)':>14} {'tau':>6} {'tok/s':>7} {'vs plain':>9} {'agreement':>10}")
    for s, k, n in SHAPES:
        spec = ReferenceSpeculator(model, head, SpecShape(s, k, n))
        t0 = time.perf_counter()
        outs = [spec.generate(pr, args.max_new_tokens, stop) for pr in prompts]
        dt = time.perf_counter() - t0
        taus = [o.tau for o in outs]
        agree = {compare_to_greedy(model, pr, o.tokens, g).status for pr, o, g in zip(prompts, outs, greedy)}
        toks = sum(len(o.tokens) for o in outs)
        print(f"{str((s, k, n)):>14} {statistics.mean(taus):6.2f} {toks / dt:7.1f} "
              f"{toks / dt / (n_plain / t_plain):8.2f}x {','.join(sorted(agree)):>10}")


if __name__ == "__main__":
    main()
