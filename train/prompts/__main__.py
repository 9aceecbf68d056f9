"""`python -m tsengine.train.prompts --out DIR`: write the built-in collection so training can point at plain files."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from tsengine.train.prompts import CATEGORIES, write_jsonl


def _count(path) -> Counter:
    with open(path, encoding="utf-8") as fh:
        return Counter(json.loads(line)["category"] for line in fh if line.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tsengine.train.prompts", description=__doc__)
    ap.add_argument("--out", required=True, help="directory for train.jsonl and val.jsonl (created if missing)")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="share of each category held out")
    args = ap.parse_args(argv)
    train_path, val_path = write_jsonl(args.out, args.val_fraction)
    # Counted back from the written files, so the table reports what is actually on disk.
    tr, va = _count(train_path), _count(val_path)
    print(f"{'category':<14}{'train':>7}{'val':>6}{'total':>7}")
    for cat in CATEGORIES:
        print(f"{cat:<14}{tr[cat]:>7}{va[cat]:>6}{tr[cat] + va[cat]:>7}")
    t, v = sum(tr.values()), sum(va.values())
    print(f"{'all':<14}{t:>7}{v:>6}{t + v:>7}")
    print(f"wrote {train_path} and {val_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
