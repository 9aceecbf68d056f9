"""Acceptance of a head over a prompt file: τ (tokens per target forward, bonus included), temperature 0.

    python -m infer.eval --target DIR --draft DIR --prompts FILE [--steps 3 --topk 1 --num-draft-tokens 4]
        [--tree 6,8,32] [--num-prompts N] [--max-new-tokens M] [--json OUT]

Measured with the reference generator (the oracle), so the number is the head's, not an engine's. The
prompt file has the training data's shape (`messages` or `conversations`); each row's prompt is its
conversation up to the first assistant turn, rendered with the target's chat template; `--num-prompts N`
takes N evenly spaced rows in id order. Overall τ is
Σ committed tokens / Σ verify forwards (not a mean of per-prompt ratios, which over-weights short answers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tsengine.errors import UserError, run_main


def prompts_from(path: str, tok, limit: int | None) -> list[tuple[str, list[int]]]:
    from train.data import load_rows, normalize

    out = []
    for i, row in enumerate(load_rows(path)):
        try:
            msgs = normalize(row, require_assistant=False)
        except ValueError:
            continue
        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        if first == 0 or msgs[first - 1]["role"] != "user":
            continue
        text = tok.apply_chat_template(msgs[:first], tokenize=False, add_generation_prompt=True)
        out.append((str(row.get("id", i)), tok(text, add_special_tokens=False)["input_ids"]))
    if not out:
        raise UserError(f"prompts {path}: no usable rows (need a user turn before any assistant turn)")
    out.sort(key=lambda x: x[0])  # by id: files written in another order (by length) evaluate alike
    if limit is not None and limit < len(out):  # evenly spaced, so grouped ids (categories) all show up
        out = [out[(i * len(out)) // limit] for i in range(limit)]
    return out


def evaluate(model, tok, head, prompts, shapes, max_new_tokens: int, progress: bool = True) -> dict:
    """{"S,K,N": {"tau", "tokens", "verify_steps", "per_prompt": [...], "accept_hist": [...]}}."""
    from tqdm import tqdm

    from infer.reference import ReferenceSpeculator, SpecShape
    from tsengine.targets import eos_ids

    stop = eos_ids(model, tok)
    results = {}
    for s, k, n in shapes:
        spec = ReferenceSpeculator(model, head, SpecShape(s, k, n))
        rows, hist = [], [0] * (s + 2)
        for pid, ids in tqdm(prompts, desc=f"eval {s},{k},{n}", disable=not progress):
            o = spec.generate(ids, max_new_tokens, stop)
            steps = len(o.accept_lengths)
            rows.append({"id": pid, "tokens": len(o.tokens) - 1, "verify_steps": steps, "tau": o.tau})
            for a in o.accept_lengths:
                hist[min(a, s + 1)] += 1
        toks, steps = sum(r["tokens"] for r in rows), sum(r["verify_steps"] for r in rows)
        results[f"{s},{k},{n}"] = {"steps": s, "topk": k, "num_draft_tokens": n, "tau": toks / max(steps, 1),
                                   "tokens": toks, "verify_steps": steps, "per_prompt": rows,
                                   "accept_hist": hist}
    return results


def table(results: dict) -> str:
    lines = [f"{'S,K,N':>9} {'tau':>6} {'tokens':>7} {'verifies':>9}  tau per prompt (min / median / max)"]
    for key, r in results.items():
        taus = sorted(p["tau"] for p in r["per_prompt"])
        lines.append(f"{key:>9} {r['tau']:6.2f} {r['tokens']:7d} {r['verify_steps']:9d}  "
                     f"{taus[0]:.2f} / {taus[len(taus) // 2]:.2f} / {taus[-1]:.2f}")
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int, int]:
    try:
        s, k, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S,K,N (three integers), got {text!r}") from None
    return s, k, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.eval", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", required=True, help="JSON/JSONL/Parquet rows (messages or conversations)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int)
    p.add_argument("--tree", type=_shape, action="append", default=[], help="also a tree S,K,N (repeatable)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", help="write the full results here")
    args = p.parse_args(argv)

    def body() -> None:
        from infer.reference import SpecShape
        from tsengine.eagle3.format import load_head
        from tsengine.targets import load_target

        n = args.num_draft_tokens or (args.steps + 1 if args.topk == 1 else None)
        if n is None:
            raise UserError("--num-draft-tokens is required for a tree (--topk > 1)")
        shapes = [(args.steps, args.topk, n)] + args.tree
        for s in shapes:
            SpecShape(*s).check()
        model, tok = load_target(args.target)
        head = load_head(args.draft, target=model.config, embeddings=model.get_input_embeddings().weight)
        results = evaluate(model, tok, head, prompts_from(args.prompts, tok, args.num_prompts), shapes,
                           args.max_new_tokens)
        print(table(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    return run_main("eval", body)


if __name__ == "__main__":
    sys.exit(main())
