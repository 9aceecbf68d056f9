"""What an adaptive engine pays over plain decoding on the steps where it decodes plainly (issue 43: adaptive
speculation is the default with a head, so its plain steps must run at plain decoding's speed).

In one process, side by side, the same requests (built-in validation prompts, greedy, EOS ignored) at each
batch size:

    python bench/adaptive_overhead.py --draft DIR [--batches 4,16 --max-tokens 96 --repeats 3 --heat --profile
        --no-prefix-caching]

Rows: `plain` (no head), `adaptive, forced plain` (the default adaptive engine whose policy is replaced by
one that always answers plain: every step pays the adaptive machinery and decodes plainly) and `adaptive`
(the policy deciding). Reports output tok/s (median of the repeats, rows interleaved per repeat) and the
ratio to plain. The adaptive row's trace gives per kind of step its steps, eager steps, time per step and
the tokens per second it delivered against what the policy predicted (corrected) when choosing it.
Prefix caching is on, as in a server (the prompts repeat, so every timed run's prompts are cached hits,
as in bench/serve_throughput.py: an adaptive engine that keyed fewer blocks pays their prefill).
`--heat` first runs the adaptive engine once per chain length with the plan forced, so every chain shape
at that batch is compiled, as on a server that has run a while. `--profile` prints the forced-plain row's
top functions by own time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import Counter, defaultdict

from engine_speed import val_prompts


def forced_plain(llm) -> None:
    from tsengine.speculative.adaptive.plan import Arm, Plan

    llm.engine.proposer.policy.choose = lambda stats, *_a, **_k: Plan(Arm(0), ["plain"] * len(stats))


def forced_chain(llm, k: int) -> None:
    from tsengine.speculative.adaptive.plan import Arm, Plan

    llm.engine.proposer.policy.choose = lambda stats, *_a, **_k: Plan(Arm(k), ["eagle3"] * len(stats))


def traced(llm) -> dict:
    """Per kind of step the adaptive engine ran (the plan chosen the step before): [steps, eager steps,
    seconds, tokens committed, sum of predicted tokens/s]."""
    engine, trace = llm.engine, defaultdict(lambda: [0, 0, 0.0, 0, 0.0])
    step, forward = engine.step, engine.runner.run
    graph = [False]

    def run(batch):
        out = forward(batch)
        graph[0] = out.graph
        return out

    def timed():
        last = engine.proposer.policy.last
        kind = last.kind + (" (explored)" if last.explored else "")
        t0 = time.perf_counter()
        out = step()
        row = trace[kind]
        row[0] += 1
        row[1] += not graph[0]
        row[2] += time.perf_counter() - t0
        row[3] += tokens[0]
        row[4] += last.tokens_per_s
        tokens[0] = 0
        return out

    policy = engine.proposer.policy
    learn, tokens = policy.learn, [0]

    def learned(proposal, **kwargs):  # the tokens the step committed (its verify of the plan chosen the step before)
        tokens[0] = proposal.tokens
        return learn(proposal, **kwargs)

    proposer = engine.proposer
    catch_up = proposer._catch_up

    def caught_up(runs):  # the head's catch-up over rows kept while it did not draft: rows and seconds
        rows = sum(c.seq.head_backlog.rows for c in runs)
        seconds = catch_up(runs)
        row = trace["  head catch-up (rows in column 2)"]
        row[0], row[1], row[2] = row[0] + 1, row[1] + rows, row[2] + seconds
        return seconds

    engine.step, engine.runner.run, proposer._catch_up, policy.learn = timed, run, caught_up, learned
    return trace


def run(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    from tsengine.entrypoints.llm import LLM
    from tsengine.model.compile_worker import WORKER
    from tsengine.sampling_params import SamplingParams
    from tsengine.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heat", action="store_true", help="compile every chain shape first (forced chains)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    path = str(resolve(args.target))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.steps}  # adaptive: the default
    for batch in (int(b) for b in args.batches.split(",")):
        kw = dict(max_num_seqs=batch, enable_prefix_caching=not args.no_prefix_caching)
        rows = {"plain": LLM(path, **kw), "adaptive, forced plain": LLM(path, speculative_config=spec, **kw),
                "adaptive": LLM(path, speculative_config=spec, **kw)}
        forced_plain(rows["adaptive, forced plain"])
        prompts = val_prompts(rows["plain"].tokenizer, batch)
        for llm in rows.values():  # warm-up: every graph the timed runs need, compiled before the clock
            for _ in range(2):
                llm.generate(prompts, params, use_tqdm=False)
                WORKER.wait()
        if args.heat:
            adaptive = rows["adaptive"].engine.proposer.policy
            choose = adaptive.choose
            for k in range(1, args.steps + 1):
                forced_chain(rows["adaptive"], k)
                for _ in range(2):
                    rows["adaptive"].generate(prompts, params, use_tqdm=False)
                    WORKER.wait()
            adaptive.choose = choose
            rows["adaptive"].generate(prompts, params, use_tqdm=False)
            WORKER.wait()
        speeds = {name: [] for name in rows}
        policy = rows["adaptive"].engine.proposer.policy
        chosen, compiled = Counter(policy.chosen), WORKER.compiled
        trace = traced(rows["adaptive"])
        for _ in range(args.repeats):
            for name, llm in rows.items():
                speeds[name].append(run(llm, prompts, params))
        steps = Counter(policy.chosen)
        steps.subtract(chosen)
        print(f"batch {batch:3d} | adaptive's steps in the timed runs: {dict(+steps)}; graphs compiled meanwhile: "
              f"{WORKER.compiled - compiled}", flush=True)
        for kind, (n, eager, seconds, committed, predicted) in sorted(trace.items()):
            delivered = f", {committed / seconds:6.1f} tok/s vs {predicted / n:6.1f} predicted" if committed else ""
            print(f"batch {batch:3d} | adaptive {kind:25s}: {n:4d} steps, {eager:3d} eager, "
                  f"{seconds / n * 1e3:7.1f} ms per step{delivered}", flush=True)
        plain = statistics.median(speeds["plain"])
        for name, s in speeds.items():
            med = statistics.median(s)
            print(f"batch {batch:3d} | {name:24s} | {med:7.1f} tok/s | {med / plain:.3f}x plain | "
                  f"runs {' '.join(f'{x:.1f}' for x in s)}", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            run(rows["adaptive, forced plain"], prompts, params)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        del rows


if __name__ == "__main__":
    main()
