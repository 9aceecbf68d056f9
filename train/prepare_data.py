"""Stage: chat rows -> tokenized examples (input_ids + assistant-only loss_mask), saved with `datasets`.

    python -m tsengine.train.prepare_data --target smollm2-135m --data regen.jsonl --out prepared/train

The output is an Arrow dataset (`save_to_disk`), memory-mapped by the trainer and the feature dump, with
a stage marker whose key covers the input file, the tokenizer and max_length (stale data is never reused).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tsengine.conversations import load_rows
from tsengine.errors import UserError, run_main
from tsengine.train.data import build
from tsengine.train.stages import StageDir, digest, is_done, tokenizer_digest


def prepare(tok, source: str | Path, out: str | Path, max_length: int, max_samples: int | None = None,
            quiet: bool = False) -> Path:
    """Tokenize `source` into `out` unless it is already there for the same inputs."""
    import datasets

    out, src = Path(out), Path(source)
    key = digest(src if src.is_file() else str(source), tokenizer_digest(tok), max_length, max_samples)
    if is_done(out, key):
        return out
    rows = load_rows(str(source))
    if max_samples is not None:
        rows = rows.select(range(min(max_samples, len(rows)))) if hasattr(rows, "select") else list(rows)[:max_samples]
    examples, skipped = build(tok, rows, max_length)
    if not examples:
        raise UserError(f"data {source}: no usable rows ({skipped.summary(0)})")
    n_tokens = sum(len(e.input_ids) for e in examples)
    n_loss = sum(sum(e.loss_mask) for e in examples)
    info = {"source": str(source), "rows": len(examples), "tokens": n_tokens, "loss_tokens": n_loss,
            "skipped": dict(skipped.reasons)}
    with StageDir(out, key, info) as tmp:
        ds = datasets.Dataset.from_dict({"input_ids": [e.input_ids for e in examples],
                                         "loss_mask": [e.loss_mask for e in examples]})
        ds.save_to_disk(str(tmp / "data"))
    if not quiet:
        print(f"prepare_data: {skipped.summary(len(examples))}; {n_tokens} tokens, {n_loss} trained on -> {out}")
    return out


def load_prepared(path: str | Path):
    import datasets

    p = Path(path) / "data"
    if not p.exists():
        raise UserError(f"prepared data {path}: missing (run python -m tsengine.train.prepare_data first)")
    return datasets.load_from_disk(str(p)).with_format("python")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsengine.train.prepare_data", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="tokenizer source: HF dir, embedded name or hub id")
    p.add_argument("--data", required=True, help="JSON/JSONL/Parquet file or directory, or a hub dataset")
    p.add_argument("--out", required=True)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--max-samples", type=int)
    args = p.parse_args(argv)

    def body() -> None:
        from transformers import AutoTokenizer

        from tsengine.targets import resolve

        tok = AutoTokenizer.from_pretrained(resolve(args.target))
        prepare(tok, args.data, args.out, args.max_length, args.max_samples)

    return run_main("prepare_data", body)


if __name__ == "__main__":
    sys.exit(main())
