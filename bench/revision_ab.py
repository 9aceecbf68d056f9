"""A/B of two revisions of the engine on the same machine state: `bench/engine_speed.py` run from each
checkout in turn (A, B, A, B, ...), so drift of the machine hits both sides alike. Each run already puts
plain / EAGLE-3 / NGRAM rows side by side in one process; this prints the per-row median tok/s and τ of
each revision over its runs.

    python bench/revision_ab.py --a OLD_CHECKOUT --b . --rounds 2 -- --draft DIR --shapes "3,1,4;4,8,32" \
        --ngram --no-hf --prompts 4 --max-tokens 64 --repeats 3

Checkout A is typically `git worktree add /tmp/ab_old REV`. Each side runs with its own directory first on
PYTHONPATH; the editable install maps `tsengine.train`/`tsengine.infer` to the installed checkout, so link
A's own (`ln -s ../train tsengine/train; ln -s ../infer tsengine/infer`). A row whose outputs differ from
the plain row stops the A/B.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROW = re.compile(r"^\| (?P<row>[^|]+?) \| (?P<tps>[\d.]+) \| [^|]* \| [^|]* \| (?P<tau>[^|]+?) \|")


def run_once(checkout: Path, args: list[str]) -> dict[str, tuple[float, str]]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, str(checkout / "bench" / "engine_speed.py"), *args], cwd=checkout, env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = {m["row"]: (float(m["tps"]), m["tau"].strip()) for m in map(ROW.match, out.splitlines()) if m}
    equal = [line for line in out.splitlines() if "outputs equal the plain row" in line]
    print(out.split("\n\n", 1)[-1].strip() if rows else out, flush=True)
    if any(not re.search(r"(\d+)/\1 outputs", line) for line in equal):
        raise SystemExit(f"{checkout}: a speculative row changed the output:\n" + "\n".join(equal))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, type=Path, help="checkout A (e.g. a git worktree of the old revision)")
    ap.add_argument("--b", required=True, type=Path, help="checkout B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench/engine_speed.py's arguments")
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(a.rounds):
        for side, checkout in (("A", a.a.resolve()), ("B", a.b.resolve())):
            print(f"\n== round {r + 1}, {side}: {checkout}", flush=True)
            runs[side].append(run_once(checkout, bench_args))
    names = list(runs["A"][0])
    print(f"\nmedian tok/s over {a.rounds} runs each (A = {a.a}, B = {a.b}); τ of the last run")
    print("| row | A tok/s | B tok/s | B / A | τ A | τ B |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        ta = statistics.median(x[name][0] for x in runs["A"])
        tb = statistics.median(x[name][0] for x in runs["B"] if name in x)
        print(f"| {name} | {ta:.1f} | {tb:.1f} | {tb / ta:.2f} | {runs['A'][-1][name][1]} | {runs['B'][-1][name][1]} |")


if __name__ == "__main__":
    main()
