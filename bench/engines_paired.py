"""Engines side by side in one process (a server's concurrency level without the server): plain decoding,
pinned EAGLE-3 chains, the adaptive default and the adaptive engine forced to decode plainly (`forced`:
what its machinery costs on plain steps), each round running the same prompts (built-in validation
prompts, greedy, EOS ignored) through every engine in turn, so a machine whose speed drifts moves every row
alike. `--concurrency C` keeps C requests in flight, each finished one replaced by the next prompt at once
(the clients of `bench/serve_throughput.py`, which start apart once the first ends); 1: one at a time.

    python bench/engines_paired.py --draft DIR [--engines chain3,adaptive,chain1,plain,forced --prompts 16
        --max-tokens 96 --rounds 5 --concurrency 1 --prefix-caching]

Prints output tok/s per round and engine, then the medians, and what the adaptive policy chose.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from engine_speed import val_prompts

IDS = itertools.count()


def speculative_config(engine: str, draft: str) -> dict | None:
    if engine == "plain":
        return None
    if engine in ("adaptive", "forced"):
        return {"method": "eagle3", "model": draft, "num_speculative_tokens": 3, "adaptive": True}
    if engine.startswith("chain") and engine[5:].isdigit():
        return {"method": "eagle3", "model": draft, "num_speculative_tokens": int(engine[5:]), "adaptive": False}
    raise SystemExit(f"--engines: unknown engine {engine!r} (allowed: plain, adaptive, forced, chainK)")


def closed_loop(engine, prompts: list[list[int]], params, concurrency: int) -> None:
    """Every prompt through `engine`, `concurrency` in flight: a finished request's slot takes the next
    prompt before the next step."""
    queue = list(reversed(prompts))
    for _ in range(min(concurrency, len(queue))):
        engine.add_request(f"paired-{next(IDS)}", queue.pop(), params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and queue:
                engine.add_request(f"paired-{next(IDS)}", queue.pop(), params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="the EAGLE-3 head's directory")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engines", default="chain3,adaptive,chain1,plain")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="as a server runs by default (the prompts then hit the cache from the second round on)")
    args = ap.parse_args()

    from tsengine.entrypoints.llm import LLM
    from tsengine.model.compile_worker import WORKER
    from tsengine.sampling_params import SamplingParams
    from tsengine.speculative.adaptive.plan import Arm, Plan
    from tsengine.targets import resolve

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    names = args.engines.split(",")
    configs = {name: speculative_config(name, args.draft) for name in names}
    c = args.concurrency
    llms = {name: LLM(str(resolve(args.model)), speculative_config=configs[name],
                      enable_prefix_caching=args.prefix_caching, max_num_seqs=max(4, c),
                      kv_cache_memory=(256 << 20) * (1 + c))  # a small cache each
            for name in names}
    if "forced" in llms:
        llms["forced"].engine.proposer.policy.choose = lambda stats, *_a, **_k: Plan(Arm(0), ["plain"] * len(stats))
    prompts = val_prompts(next(iter(llms.values())).tokenizer, args.prompts)
    for llm in llms.values():  # warm-up: every engine meets its shapes, then every graph compiles
        closed_loop(llm.engine, prompts[: max(c, len(prompts) // 2)], params, c)
    WORKER.wait()
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            closed_loop(llm.engine, prompts, params, c)
            speeds[name].append(len(prompts) * args.max_tokens / (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in speeds.items())
              + f" tok/s (graphs compiled so far: {WORKER.compiled})", flush=True)
    print("medians: " + ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in speeds.items()) + " tok/s")
    for name in ("adaptive", "forced"):
        if name in llms:
            print(f"{name} chose:", dict(llms[name].engine.proposer.policy.chosen))


if __name__ == "__main__":
    main()
