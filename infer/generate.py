"""Reference speculative generation from the command line (slow on purpose: it is the oracle).

    python -m tsengine.infer.generate --target DIR --draft DIR --prompt TEXT [--steps S --topk K
        --num-draft-tokens N --max-new-tokens M] [--raw] [--json] [--check-greedy]
"""

from __future__ import annotations

import argparse
import json
import sys

from tsengine.errors import UserError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tsengine.infer.generate", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF directory, embedded name (smollm2-135m) or hub id")
    p.add_argument("--draft", required=True, help="EAGLE-3 head directory (export format)")
    p.add_argument("--prompt", required=True, help="one user message (or plain text with --raw)")
    p.add_argument("--steps", type=int, default=3, help="draft steps S (default 3)")
    p.add_argument("--topk", type=int, default=1, help="children per expansion K; 1 = chain (default 1)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tree nodes incl. root N (chain: S+1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check-greedy", action="store_true", help="also decode plainly and compare (exit 1 on mismatch)")
    return p


def run(args) -> int:
    from tsengine.eagle3.format import load_head
    from tsengine.infer.reference import ReferenceSpeculator, SpecShape, compare_to_greedy, greedy_generate
    from tsengine.targets import encode_prompt, eos_ids, load_target

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens is {args.max_new_tokens}; must be >= 1")
    n = args.num_draft_tokens if args.num_draft_tokens is not None else (args.steps + 1 if args.topk == 1 else None)
    if n is None:
        raise UserError("--num-draft-tokens is required for a tree (--topk > 1)")
    shape = SpecShape(args.steps, args.topk, n).check()
    model, tok = load_target(args.target)
    head = load_head(args.draft, target=model.config, embeddings=model.get_input_embeddings().weight)
    prompt = encode_prompt(tok, args.prompt, args.raw)
    stop = eos_ids(model, tok)
    out = ReferenceSpeculator(model, head, shape).generate(prompt, args.max_new_tokens, stop)
    result = {"tokens": out.tokens, "accept_lengths": out.accept_lengths,
              "text": tok.decode(out.tokens, skip_special_tokens=True)}
    verdict = None
    if args.check_greedy:
        verdict = compare_to_greedy(model, prompt, out.tokens,
                                    greedy_generate(model, prompt, args.max_new_tokens, stop))
        result["greedy_check"] = {"status": verdict.status, "position": verdict.position, "rel_gap": verdict.rel_gap}
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(f"\naccepted per verify step: {out.accept_lengths}")
        print(f"tau (tokens per verify forward): {out.tau:.2f} over {len(out.accept_lengths)} verify steps")
        if verdict is not None:
            print(f"greedy check: {verdict}")
    return 1 if verdict is not None and verdict.status == "mismatch" else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"tsengine.infer.generate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
