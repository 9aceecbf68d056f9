"""The regenerate stage's output tokens/s: HF `generate` (the old path) vs the engine, same rows and settings.

    python bench/regen_speed.py [--prompts 96 --max-new-tokens 160 --batch 32 --engine-seqs 32,64]

All rows run in one process, one after the other, on the same built-in training prompts (a seeded subset,
as the recipe takes them), greedy, EOS honoured as in the real stage: each backend writes what the stage
writes (JSONL for HF and the plain engine; shards with features for the capturing engine, which also
replaces the feature-dump pass). Output tokens are counted from what was written; the engine-vs-HF greedy
answers are compared (a difference is printed: HF pads left and runs its own kernels, so a near-tie can
differ; it is never hidden).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def prompts(n: int, seed: int = 0) -> list[dict]:
    from tsengine.train.prompts import write_jsonl

    rows = [json.loads(x) for x in Path(write_jsonl(tempfile.mkdtemp())[0]).read_text().splitlines()]
    return [{**r, "temperature": 0.0} for r in random.Random(seed).sample(rows, n)]


def output_tokens(tok, records: list[dict]) -> int:
    """Tokens of the written replies (+1 for the stop token of a finished one): one count for every
    JSONL-writing row, so that no backend is credited with tokens it did not write."""
    return sum(len(tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) + int(r["finished"])
               for r in records)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch", type=int, default=32, help="HF generate batch (the recipe's regen.batch_size)")
    p.add_argument("--engine-seqs", default="32,64", help="engine max_num_seqs values, one row each")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--dtypes", default="float32", help="the engine's dtype for each engine row (float32,bfloat16)")
    args = p.parse_args()

    from tsengine.eagle3.config import default_aux_layer_ids
    from tsengine.targets import load_target, resolve
    from tsengine.train.features import ShardWriter
    from tsengine.train.regen_engine import EngineRegenerator
    from tsengine.train.regenerate import Regenerator

    path = str(resolve(args.target))
    model, tok = load_target(path)
    rows = prompts(args.prompts)
    work = Path(tempfile.mkdtemp())
    results, answers = [], {}

    def row(name: str, seconds: float, tokens: int, records=None):
        results.append((name, tokens / seconds, tokens, seconds))
        if records is not None:
            answers[name] = {r["id"]: r["messages"][-1]["content"] for r in records}
        print(f"{name:<34} {tokens / seconds:8.1f} tok/s  ({tokens} tokens in {seconds:.1f} s)", flush=True)

    if not args.no_hf:
        out = work / "hf.jsonl"
        t0 = time.perf_counter()
        Regenerator(model, tok, args.batch, args.max_new_tokens).run(rows, out, progress=False)
        recs = [json.loads(x) for x in out.read_text().splitlines()]
        row(f"HF generate (batch {args.batch})", time.perf_counter() - t0, output_tokens(tok, recs), recs)
    dtypes = args.dtypes.split(",")
    for dtype in dtypes:
        for seqs in [int(x) for x in args.engine_seqs.split(",")]:
            out = work / f"engine{seqs}-{dtype}.jsonl"
            regen = EngineRegenerator(path, tok, seqs, args.max_new_tokens, dtype=dtype)
            t0 = time.perf_counter()
            regen.run(rows, out, progress=False)
            recs = [json.loads(x) for x in out.read_text().splitlines()]
            row(f"engine {dtype} (max_num_seqs {seqs})", time.perf_counter() - t0, output_tokens(tok, recs), recs)
    seqs = int(args.engine_seqs.split(",")[-1])
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    for dtype in dtypes:
        writer = ShardWriter(work / f"capture-{dtype}", "bench", "shard", "float32", 32768)
        regen = EngineRegenerator(path, tok, seqs, args.max_new_tokens, capture_layer_ids=layers, dtype=dtype)
        t0 = time.perf_counter()
        regen.run(rows, writer=writer, progress=False)
        # exact count of generated tokens
        row(f"engine {dtype} + capture (max_num_seqs {seqs})", time.perf_counter() - t0, regen.tokens_out)
    base = results[0][1]
    print("\n| backend | output tok/s | vs first row | tokens | wall s |\n| --- | --- | --- | --- | --- |")
    for name, rate, tokens, seconds in results:
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {tokens} | {seconds:.1f} |")
    names = list(answers)
    for other in names[1:]:
        same = sum(answers[names[0]][k] == answers[other].get(k) for k in answers[names[0]])
        print(f"{other}: {same}/{len(answers[names[0]])} answers equal to {names[0]}'s")


if __name__ == "__main__":
    main()
