"""How long requests wait for graph compiles: time to ready, a first request against the same request on
a warm engine, and the longest step (inter-token gap) while a new shape compiles (issue 43 item 1).

Each arm is a fresh process with its own inductor cache directory, so "cold" is a first start on a new
machine and "warm" a restart with the cache on disk:
- `lazy`: the old behaviour, compiles on the engine thread when a shape is hot (TSENGINE_GRAPH_COMPILE=inline)
  and no warm-up;
- `background`: the default, warm-up before ready, other shapes compile off the engine thread.
Per arm: the engine start (`load_s`), `ready_s` (after the warm-up, if any), one chat request of 128 tokens
three times in a row (the first is the one a user waits on; the third is the warm reference), then four such
requests at once (a batch shape the warm-up did not compile) twice, with the longest step of each.

    python bench/compile_stalls.py --draft runs/smollm2-135m/export --out /tmp/compile-stalls
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a cat who learns to fly."


def arm(model: str, draft: str | None, warmup: bool, tokens: int) -> dict:
    """One engine in this process (the environment picks the compile mode and cache directory)."""
    t0 = time.perf_counter()
    from tsengine.config import EngineConfig, SpeculativeConfig
    from tsengine.engine import Engine
    from tsengine.sampling_params import SamplingParams

    spec = None if draft is None else SpeculativeConfig.resolve(config_json={
        "method": "eagle3", "model": draft, "num_speculative_tokens": 3, "adaptive": False})
    e = Engine(EngineConfig.make(model=model, speculative=spec))
    out = {"load_s": time.perf_counter() - t0}
    if warmup:
        e.warm_up()
    out["ready_s"] = time.perf_counter() - t0
    text = e.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=False)
    prompt = e.tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def run(n: int, tag: str) -> tuple[float, float]:
        for i in range(n):
            e.add_request(f"{tag}-{i}", prompt, params)
        t, longest = time.perf_counter(), 0.0
        while e.has_unfinished():
            s = time.perf_counter()
            e.step()
            longest = max(longest, time.perf_counter() - s)
        return time.perf_counter() - t, longest

    singles = [run(1, f"one{i}") for i in range(3)]
    batches = [run(4, f"four{i}") for i in range(2)]
    out.update(first_s=singles[0][0], first_longest_step_s=singles[0][1], warm_s=singles[2][0],
               warm_longest_step_s=singles[2][1], batch4_first_s=batches[0][0],
               batch4_first_longest_step_s=batches[0][1], batch4_warm_s=batches[1][0],
               batch4_warm_longest_step_s=batches[1][1])
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2, pulled)")
    ap.add_argument("--draft", default=None, help="an EAGLE-3 head: adds the chain (3,1,4) rows")
    ap.add_argument("--out", default="/tmp/compile-stalls", help="JSON results and the arms' caches")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="lazy,background", help="which arms (lazy: the old behaviour)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = ap.parse_args()
    if args.arm:
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7d %(threadName)s %(message)s")
        draft, mode = args.arm.split(":")
        print("RESULT " + json.dumps(arm(args.model, None if draft == "plain" else args.draft,
                                          mode == "background", args.tokens)), flush=True)
        return
    if args.model is None:
        from tsengine.targets import pull

        args.model = str(pull("smollm2-135m"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in ["plain"] + (["chain"] if args.draft else []):
        for mode, starts in (("lazy", ("cold",)), ("background", ("cold", "warm"))):
            if mode not in args.modes.split(","):
                continue
            cache = out / f"inductor-{method}-{mode}"
            shutil.rmtree(cache, ignore_errors=True)
            for start in starts:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                       "TSENGINE_GRAPH_COMPILE": "inline" if mode == "lazy" else "background"}
                cmd = [sys.executable, __file__, "--arm", f"{method}:{mode}", "--model", args.model,
                       "--tokens", str(args.tokens)] + (["--draft", args.draft] if args.draft else [])
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                (out / f"{method}-{mode}-{start}.log").write_text(proc.stderr)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{method} {mode} {start} failed:\n{proc.stderr[-3000:]}")
                row = {"method": method, "mode": mode, "start": start, **json.loads(line[7:])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    keys = ["ready_s", "first_s", "first_longest_step_s", "warm_s", "batch4_first_s",
            "batch4_first_longest_step_s", "batch4_warm_s"]
    print("| method | compile | start | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (3 + len(keys)))
    for r in rows:
        print(f"| {r['method']} | {r['mode']} | {r['start']} | " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
