"""Would a compiled graph pay for a small prefill chunk? One request's chunk of n rows after a cached prefix of
150 positions (a chat turn's uncached tail under prefix caching), eager against a graph padded to a multiple
of 8 rows that forms the logits of its last row only. SmolLM2 fp32, batch 1; prints each graph's compile
time, the logits' largest difference and the median of 7 alternating timings.

    python bench/prefill_graph.py [--rows 8,24,40]

A probe for issue 17's cached time-to-first-token floor (docs/benchmarks.md): the engine has no such graph.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PREFIX = 150


def main() -> None:
    from tsengine.cache.kv_cache import scratch_slot
    from tsengine.entrypoints.llm import LLM
    from tsengine.model.context import Context
    from tsengine.model.graph_compiler import compile_step
    from tsengine.model.graphs import MIN_CONTEXT, static_step
    from tsengine.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,24,40")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    r = LLM(resolve("smollm2-135m"), max_num_seqs=1, enforce_eager=False, enable_prefix_caching=False).engine.runner
    bs, scratch = r.block_size, scratch_slot(r.kv)
    for n in (int(x) for x in args.rows.split(",")):
        window = -(-n // 8) * 8
        table = list(range(-(-(PREFIX + window) // bs)))
        ids = torch.randint(0, 40000, (n,))
        tables = torch.tensor([table + [0] * (MIN_CONTEXT // bs - len(table))])
        graph = compile_step(static_step, r.model, r.kv, bs, window, key=("prefill_probe", n))

        def eager():
            ctx = Context.build([(table, PREFIX, n)], bs, "cpu")
            hidden, _ = r.model(ids, ctx, r.kv)
            return r.model.logits(hidden[-1:])

        def compiled():
            ctx, pad = Context.build([(table, PREFIX, n)], bs, "cpu"), window - n
            positions = torch.cat([ctx.positions, ctx.positions[-1:].expand(pad)])  # padding: the last position
            slots = torch.cat([ctx.slot_mapping, ctx.slot_mapping.new_full((pad,), scratch)])  # and no real slot
            return graph(torch.cat([ids, ids.new_zeros(pad)]), positions, slots, tables, ctx.context_lens, None,
                         None, torch.tensor([n - 1]))[2]

        t = time.perf_counter()
        compiled()
        print(f"rows {n}: compiled in {time.perf_counter() - t:.1f} s", flush=True)
        want, got = eager(), compiled()
        print(f"  logits max |diff| {(want - got).abs().max().item():.2g}, "
              f"argmax equal: {torch.equal(want.argmax(-1), got.argmax(-1))}")
        times: dict[str, list[float]] = {"eager": [], "graph": []}
        for _ in range(7):
            for name, fn in (("eager", eager), ("graph", compiled)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        print(f"  {n} rows (window {window}): eager {statistics.median(times['eager']) * 1e3:.1f} ms, "
              f"graph {statistics.median(times['graph']) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
