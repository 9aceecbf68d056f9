"""Stage: the draft vocabulary, the N most frequent assistant tokens of the training data.

    python -m tsengine.train.vocab --data prepared/train --target smollm2-135m --draft-vocab-size 32000 --out vocab/

Counting only loss-masked tokens matches what the head is asked to predict. The result is cached under a
key of (tokenizer, dataset fingerprint, N) in `out/<key>/`, so a different dataset or tokenizer never
reuses a stale mapping; the mapping itself is `tsengine.eagle3.vocab.vocab_map` (the engine's definition).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tsengine.eagle3.vocab import vocab_map
from tsengine.errors import UserError, run_main
from tsengine.train.stages import StageDir, digest, is_done, read_marker, tokenizer_digest


def count_tokens(dataset, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for row in dataset:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size).to(torch.float64)
    return counts


def build_vocab(tok, prepared: Path, vocab_size: int, draft_vocab_size: int, out_root: Path,
                quiet: bool = False) -> Path:
    """Directory holding vocab.safetensors (d2t, t2d, counts) for these inputs; built once."""
    from tsengine.train.prepare_data import load_prepared

    marker = read_marker(prepared)
    if marker is None:
        raise UserError(f"prepared data {prepared}: no stage marker (run python -m tsengine.train.prepare_data)")
    key = digest(tokenizer_digest(tok), marker["key"], vocab_size, draft_vocab_size)
    out = Path(out_root) / key
    if is_done(out, key):
        return out
    counts = count_tokens(load_prepared(prepared), vocab_size)
    d2t, t2d = vocab_map(vocab_size, draft_vocab_size, counts)
    seen = int((counts > 0).sum())
    covered = float(counts[t2d].sum() / counts.sum().clamp(min=1))
    with StageDir(out, key, {"draft_vocab_size": draft_vocab_size, "distinct_tokens_seen": seen,
                             "coverage": round(covered, 6)}) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(tmp / "vocab.safetensors"))
    if not quiet:
        print(f"vocab: {draft_vocab_size} draft ids cover {covered:.2%} of assistant tokens "
              f"({seen} distinct seen{', padded with unseen ids' if seen < draft_vocab_size else ''}) -> {out}")
    return out


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(Path(path) / "vocab.safetensors"))
    return t["d2t"], t["t2d"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsengine.train.vocab", description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="prepared data directory (python -m tsengine.train.prepare_data)")
    p.add_argument("--target", required=True)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--out", required=True, help="cache root; the mapping lands in OUT/<key>/")
    args = p.parse_args(argv)

    def body() -> None:
        from transformers import AutoConfig, AutoTokenizer

        from tsengine.targets import resolve

        path = resolve(args.target)
        tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
        build_vocab(tok, Path(args.data), cfg.vocab_size, args.draft_vocab_size, Path(args.out))

    return run_main("vocab", body)


if __name__ == "__main__":
    sys.exit(main())
