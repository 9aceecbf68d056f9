"""The EAGLE-3 head's compiled graphs, on the target's compiler, buckets and heat rule
(`tsengine/model/graphs.py`).

The EAGLE-3 head has graphs of its own (`DraftGraphs`). A greedy step where every request drafts a chain is one
graph: the head's extension over each request's committed rows, padded to a window of 1, 4 or 8 rows (the rows
a step commits change every step, the window does not), then the whole chain, whose KV stays inside the graph
(tsengine/speculative/chain_kv.py: the extension is the graph's one cache write). At batch 1 (int8 head,
chain of 3) it took about a fifth off drafting per step against one graph per chain step (measured:
docs/benchmarks-journal.md, "One graph for the draft"). After an extension that runs eagerly (it fits no
graph, or some request does not draft) the chain alone is a graph. The extension alone is one only opt-in
(`TSENGINE_EXTEND_GRAPHS=1`, for trees and sampled rows): it showed no gain (a fixed chain of 1 at 16
requests ran no faster with it). The one-graph draft brings back what issue 15 blamed it for: more
shapes (batch × window × context × chain length) that compile lazily, which stalled an adaptive server's
timed rounds (both: docs/benchmarks-journal.md, "16 requests through the server, after the age rule"); the
heat rule below keeps rare ones eager.
"""

from __future__ import annotations

import os

import torch

from tsengine.cache.kv_cache import scratch_slot, slot
from tsengine.model.compile_worker import WORKER, scratch_copy
from tsengine.model.context import Context
from tsengine.model.graph_compiler import compile_step
from tsengine.model.graphs import BATCH_BUCKETS, Heat, bucket

EXTEND_WINDOWS = (1, 4, 8)  # committed rows per request the head's extension pads to (a chain of 3 commits 1-4)


def chain_step(proposer, steps, hidden, pos, tables):
    """The traced greedy chain: [D, steps] drafts from the head's outputs `hidden` [D, H] at draft positions
    `pos` [D] (`Eagle3Proposer.greedy_chain`). The whole chain is one graph: its KV stays in the graph
    (tsengine/speculative/chain_kv.py), so nothing is written twice."""
    return proposer.greedy_chain(hidden, pos, tables, steps)


def extend_step(proposer, window, ids, aux, positions, slots, tables, lens):
    """The traced extension: the head's layer over a uniform [B, window] batch of committed rows fed with
    the target's features `aux` [B·window, 3H] (`Eagle3Proposer.propose`). Returns [B·window, H] outputs."""
    b, dev = tables.shape[0], ids.device
    ctx = Context(positions=positions, seq_index=torch.arange(b, device=dev).repeat_interleave(window),
                  slot_mapping=slots, block_tables=tables, context_lens=lens,
                  query_start=torch.arange(b + 1, device=dev) * window, max_q=window,
                  max_ctx=tables.shape[1] * proposer.block_size, exact_ctx=False, uniform=True)
    return proposer._layer(ids, proposer.head.project(aux.to(proposer.head.fc.weight.dtype)), positions, ctx)


def extend_and_chain_step(proposer, window, steps, ids, aux, positions, slots, tables, lens, last):
    """The traced draft of a greedy step: the extension (the graph's one cache write), then the chain from
    each request's last real row `last` [B]. Returns [B, steps] drafts."""
    out = extend_step(proposer, window, ids, aux, positions, slots, tables, lens)
    return proposer.greedy_chain(out[last], positions[last], tables, steps)


class DraftGraphs:
    """The head's graphs, each for one (batch bucket, context bucket) and, where they apply, one window of
    committed rows and one chain length:
    - a greedy step where every request drafts: the extension over its committed rows and the whole chain,
      one graph (`extend_and_chain`; key: batch, window, context, steps);
    - a greedy chain whose extension ran eagerly (it fits no graph, or some request does not draft): the
      chain alone (`chain`; key: batch, context, steps);
    - opt-in (`TSENGINE_EXTEND_GRAPHS=1`), the extension alone, for steps the two above do not cover (trees,
      sampled rows; key: batch, window, context).
    Padding requests draft into the scratch block of the draft cache, whose block id fills their tables; a
    request's padding rows (fewer committed rows than the window) write to the scratch slot and their outputs
    are dropped."""

    def __init__(self, proposer, contexts: tuple[int, ...], heat: Heat | None = None):
        self.proposer, self.contexts, self.heat = proposer, contexts, heat or Heat()
        self.scratch = scratch_slot([proposer.kv])
        self.scratch_block = self.scratch // proposer.block_size
        self.extends = os.environ.get("TSENGINE_EXTEND_GRAPHS", "0") == "1"  # opt-in: see the module docstring
        self.graphs: dict[tuple, object] = {}

    def _graph(self, key: tuple, fn, *bound):
        """`key`'s graph if it may run now or compile (its shape is hot); None while it is not hot, is
        compiling, or failed to compile (the caller runs eagerly)."""
        graph = self.graphs.get(key)
        if graph is None and self.heat.hot(key):
            graph = self.graphs[key] = compile_step(fn, *bound, key=key)
        return graph if graph is not None and graph.state in ("new", "ready") else None

    def _call(self, key: tuple, what: str, graph, inputs: tuple, slots: int | None = None):
        """The graph's outputs, or None while it is compiling (a new graph is submitted first; its compile's
        copy of the inputs writes only the scratch slot: `slots` is the index of the slot input)."""
        if graph.state == "new":
            WORKER.submit(graph, scratch_copy(inputs, slots, self.scratch), f"{what} {key}")
            if not graph.ready:
                return None
        return graph(*inputs)

    def fits(self, runs) -> bool:
        """Whether the runs' extension fits a graph (`extend`, `extend_and_chain`)."""
        return self._shape(runs) is not None

    def _shape(self, runs) -> tuple[int, int, int] | None:
        """(batch bucket, window, context bucket) the runs pad to, or None."""
        window = bucket(max(n for _, _, n in runs), EXTEND_WINDOWS)
        size = bucket(len(runs), BATCH_BUCKETS)
        context = bucket(max(start + n for _, start, n in runs), self.contexts)
        return None if window is None or size is None or context is None else (size, window, context)

    def _pad(self, runs, ids: list[int], aux: torch.Tensor, rows: list[int] | None, size: int, window: int,
             context: int):
        """The runs laid out as a uniform [size, window] batch: the graph's inputs (ids, features, positions,
        slots, tables, lens), and the flat indices of the real rows and of each run's last row. Row t of the
        runs reads features aux[rows[t]] (rows None: aux[t]), gathered once here; a padding row reads the
        first real row's (any finite features do: it writes to the scratch slot and its outputs are dropped)."""
        bs = self.proposer.block_size
        rows = rows if rows is not None else range(len(ids))
        positions, slots, feed, src, real, t = [], [], [], [], [], 0
        for b, (table, start, n) in enumerate(runs):  # host bookkeeping, as Context.build's
            for r in range(window):
                positions.append(start + r)
                real_row = r < n
                slots.append(slot(table, start + r, bs) if real_row else self.scratch)
                feed.append(ids[t] if real_row else 0)
                src.append(rows[t] if real_row else rows[0])
                if real_row:
                    real.append(b * window + r)
                    t += 1
        last = [b * window + n - 1 for b, (_, _, n) in enumerate(runs)] + [b * window for b in range(len(runs), size)]
        rows_pad = (size - len(runs)) * window
        cols = context // bs  # blocks held past the context bucket are never read
        tables = [table[:cols] + [0] * (cols - len(table[:cols])) for table, _, _ in runs]
        tables += [[self.scratch_block] * cols] * (size - len(runs))
        lens = [start + n for _, start, n in runs] + [1] * (size - len(runs))
        dev = aux.device

        def long(x):
            return torch.tensor(x, dtype=torch.long).to(dev)

        feats = aux[long(src + [rows[0]] * rows_pad)]
        inputs = (long(feed + [0] * rows_pad), feats, long(positions + [0] * rows_pad),
                  long(slots + [self.scratch] * rows_pad), long(tables), long(lens))
        return inputs, real, long(last)

    def extend(self, runs: list[tuple[list[int], int, int]], ids: list[int], aux: torch.Tensor) -> torch.Tensor | None:
        """The head's outputs [T, H] over the runs' committed rows (per run: block table, first position,
        rows; `ids` the tokens fed at them, `aux` [T, 3H] their features), in the runs' order; None when
        they fit no graph (a prefill chunk longer than the largest window) or the graph is off, and the caller
        runs eagerly."""
        shape = self._shape(runs) if self.extends else None
        if shape is None:
            return None
        key = ("extend", *shape)
        graph = self._graph(key, extend_step, self.proposer, shape[1])
        if graph is None:
            return None
        inputs, real, _ = self._pad(runs, ids, aux, None, *shape)
        out = self._call(key, "head extension", graph, inputs, slots=3)
        return None if out is None else out[torch.tensor(real, device=aux.device)]

    def extend_and_chain(self, runs: list[tuple[list[int], int, int]], ids: list[int], aux: torch.Tensor,
                         steps: int, rows: list[int] | None = None) -> torch.Tensor | None:
        """[D, steps] greedy drafts of every run (each run drafts), after the head's extension over their
        committed rows (arguments as `extend`'s, but the runs' row t reads features aux[rows[t]] when
        `rows` is given: the step's features are gathered once, here); None when they fit no graph or it is
        not hot yet."""
        shape = self._shape(runs)
        if shape is None:
            return None
        key = ("draft", *shape, steps)
        graph = self._graph(key, extend_and_chain_step, self.proposer, shape[1], steps)
        if graph is None:
            return None
        inputs, _, last = self._pad(runs, ids, aux, rows, *shape)
        out = self._call(key, "head extension and chain", graph, (*inputs, last), slots=3)
        return None if out is None else out[:len(runs)]

    def chain(self, steps: int, hidden, pos, tables):
        """[D, steps] greedy drafts from the head's outputs `hidden` [D, H] at draft positions `pos` [D]; None
        when the batch or its tables fit no bucket, or its graph is not hot yet."""
        d, bs = hidden.shape[0], self.proposer.block_size
        size, context = bucket(d, BATCH_BUCKETS), bucket(tables.shape[1] * bs, self.contexts)
        if size is None or context is None:
            return None
        key = ("chain", size, context, steps)
        graph = self._graph(key, chain_step, self.proposer, steps)
        if graph is None:
            return None
        padded = tables.new_full((size, context // bs), self.scratch_block)
        padded[:d] = 0
        padded[:d, :tables.shape[1]] = tables
        pad = size - d
        if pad:
            pos = torch.cat([pos, pos.new_zeros(pad)])
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        out = self._call(key, "head chain", graph, (hidden, pos, padded))  # the chain writes no cache
        return None if out is None else out[:d]
