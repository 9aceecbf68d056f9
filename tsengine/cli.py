"""`tsengine` command line: pull the embedded target, make heads (later: export, generate, serve, bench).

User mistakes surface as one `tsengine: error: ...` line and exit code 2; see tsengine/errors.py.
"""

from __future__ import annotations

import argparse
import sys

from tsengine.errors import UserError, run_main


def _pull(args) -> None:
    from tsengine.targets import pull

    print(pull(args.name, args.dir))


def _head_init(args) -> None:
    from transformers import AutoConfig

    from tsengine.eagle3.config import Eagle3Config
    from tsengine.eagle3.format import save_head
    from tsengine.eagle3.head import Eagle3Head
    from tsengine.eagle3.vocab import read_token_counts, vocab_map
    from tsengine.targets import resolve

    path = resolve(args.target)
    try:
        target = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"--target {args.target}: cannot read its config.json ({e})") from None
    cfg = Eagle3Config.for_target(target, args.draft_vocab_size, args.aux_layer_ids, args.dtype)
    counts = read_token_counts(args.token_counts, target.vocab_size) if args.token_counts else None
    head = Eagle3Head(cfg)
    head.init_weights(args.seed)
    head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, counts))
    print(save_head(head, args.out))


def _export(args) -> None:
    from train.export import export_checkpoint

    target = None
    if args.target:
        from transformers import AutoConfig

        from tsengine.targets import resolve

        target = AutoConfig.from_pretrained(resolve(args.target))
    out = export_checkpoint(args.checkpoint, args.out, target=target, dtype=args.dtype)
    print(f"exported {out}")


def _layer_ids(text: str) -> tuple[int, int, int]:
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer ids, got {text!r}") from None
    if len(ids) != 3:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer ids, got {text!r}")
    return ids


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tsengine", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    pl = sub.add_parser("pull", help="make an embedded target available as a HF checkpoint directory")
    pl.add_argument("name", help="embedded target name (smollm2-135m)")
    pl.add_argument("--dir", help="checkpoint directory to create (default: the tsengine cache)")
    pl.set_defaults(run=_pull)

    hd = sub.add_parser("head", help="EAGLE-3 head utilities").add_subparsers(dest="head_command", required=True)
    hi = hd.add_parser("init", help="write an untrained (random) head for a target, in the export format")
    hi.add_argument("--target", required=True, help="target: HF directory, embedded name or hub id")
    hi.add_argument("--out", required=True, help="output directory")
    hi.add_argument("--draft-vocab-size", type=_positive, help="draft vocab size (default min(32000, vocab))")
    hi.add_argument("--token-counts", help="JSON {token_id: count}: the draft vocab is the most frequent ids")
    hi.add_argument("--aux-layer-ids", type=_layer_ids, help="three target layer ids (outputs), e.g. 1,14,26")
    hi.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    hi.add_argument("--seed", type=int, default=0)
    hi.set_defaults(run=_head_init)

    ex = sub.add_parser("export", help="write a training checkpoint's head in the SGLang/vLLM format")
    ex.add_argument("checkpoint", help="checkpoints/step-N directory, or a run directory (latest checkpoint)")
    ex.add_argument("--out", required=True, help="output head directory")
    ex.add_argument("--target", help="also check the head fits this target (dir, embedded name or hub id)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (default: as trained)")
    ex.set_defaults(run=_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def body() -> None:
        args.run(args)

    return run_main("tsengine", body)


if __name__ == "__main__":
    sys.exit(main())
