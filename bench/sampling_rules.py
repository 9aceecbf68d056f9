"""The three verification rules side by side at one temperature: acceptance per draft position, τ, tok/s.

    python bench/sampling_rules.py --draft DIR [--temperature 0.7] [--prompts 4 --max-tokens 128 --repeats 2]
                                   [--plot docs/img/acceptance_by_position.png]

Rows (batch 1, the built-in validation prompts, every request seeded):
  plain                      no speculation
  ngram (3)                  prompt lookup, default rule
  chain (3,1,4) gumbel       the default rule: output identical to plain sampling with the same seed
  chain (3,1,4) rejection    --enable-speculative-sampling: the draft samples q, accept u·q(x) < p(x)
  tree (S,K,N) gumbel        per --shapes
  tree (S,K,N) multiround    --spec-tree-sampling multiround: point-mass multi-round rule
At temperature 0 every rule is exact matching; only the gumbel rows are run.

Acceptance at draft position k is P(accepted length ≥ k) over verify steps (for a tree: depth ≥ k on the
accepted path). The plot shows it per row; the table adds τ (tokens per verify step) and tokens/s
(median over repeats). Gumbel rows are checked token for token against plain (a mismatch is printed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_speed import engine_row, val_prompts  # noqa: E402  (this directory is on sys.path)


def main() -> None:
    from tsengine.entrypoints.llm import LLM
    from tsengine.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="trained EAGLE-3 head directory")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--shapes", default="5,4,16;4,8,32", help="tree shapes steps,topk,num_draft_tokens[;...]")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plot", help="write the acceptance-per-position plot (PNG) here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    path = resolve(args.target)
    sampled = args.temperature > 0

    def eagle(steps, topk, n, **rule):
        return {"method": "eagle3", "model": args.draft, "num_speculative_tokens": steps, "eagle_topk": topk,
                "num_draft_tokens": n, "adaptive": False, **rule}

    specs = {"plain": None, "ngram (3)": {"method": "ngram", "num_speculative_tokens": 3},
             "chain (3,1,4) gumbel": eagle(3, 1, 4)}
    if sampled:
        specs["chain (3,1,4) rejection"] = eagle(3, 1, 4, enable_speculative_sampling=True)
    for shape in args.shapes.split(";"):
        s, k, n = (int(x) for x in shape.split(","))
        specs[f"tree ({s},{k},{n}) gumbel"] = eagle(s, k, n)
        if sampled:
            specs[f"tree ({s},{k},{n}) multiround"] = eagle(s, k, n, tree_sampling="multiround")
    rows = {name: LLM(path, max_num_seqs=1, speculative_config=spec) for name, spec in specs.items()}
    prompts = val_prompts(rows["plain"].tokenizer, args.prompts)
    for llm in rows.values():
        engine_row(llm, prompts[:1], 8, args.temperature)
        st = llm.engine.stats  # warm-up excluded from the acceptance counts
        st.num_drafts = st.num_accepted = 0
        st.accepted_per_pos = [0] * len(st.accepted_per_pos)
    tps: dict[str, list[float]] = {k: [] for k in rows}
    outs = {}
    for r in range(args.repeats):
        for name, llm in rows.items():
            t, o, _, _, _ = engine_row(llm, prompts, args.max_tokens, args.temperature)
            tps[name].append(t)
            outs[name] = o
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
    print(f"\n{len(prompts)} prompts x {args.max_tokens} tokens, batch 1, temperature {args.temperature} (seeded), "
          f"tok/s median of {args.repeats}; acceptance at draft position k = P(accepted length >= k)")
    print("| row | tok/s | vs plain | τ | acceptance at position 1, 2, 3, ... |")
    print("| --- | --- | --- | --- | --- |")
    curves = {}
    base = statistics.median(tps["plain"])
    for name, llm in rows.items():
        st, med = llm.engine.stats, statistics.median(tps[name])
        if name == "plain":
            print(f"| {name} | {med:.1f} | 1.00x | - | - |")
            continue
        acc = [a / st.num_drafts for a in st.accepted_per_pos] if st.num_drafts else []
        curves[name] = acc
        print(f"| {name} | {med:.1f} | {med / base:.2f}x | {st.mean_acceptance_length:.2f} | "
              f"{', '.join(f'{a:.2f}' for a in acc)} |")
    for name in rows:
        if "gumbel" in name or "ngram" in name:
            same = sum(a == b for a, b in zip(outs[name], outs["plain"]))
            print(f"{name}: {same}/{len(prompts)} outputs equal plain sampling token for token")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, acc in curves.items():
            style = "--" if "rejection" in name or "multiround" in name else "-"
            ax.plot(range(1, len(acc) + 1), acc, style, marker="o", label=name)
        ax.set_xticks(range(1, max(len(a) for a in curves.values()) + 1))
        ax.set_xlabel("draft position k (tree: depth)")
        ax.set_ylabel("P(accepted length ≥ k)")
        ax.set_title(f"SmolLM2-135M + EAGLE-3 head, temperature {args.temperature}, batch 1")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"took {time.time() - t0:.0f} s")
