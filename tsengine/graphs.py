"""Compiled static-shape steps: one graph per (batch bucket, window, context bucket) for the target's decode
and verify steps, so the ~30 small eager ops per layer (norms, RoPE, KV writes, attention glue) fuse.

Why static shapes: a step is ~36 ms of which ~12 ms is per-op overhead on this CPU (docs/benchmarks.md).
Inductor fuses that away only with every shape fixed: the same SmolLM2 step with dynamic batch and context
measured 45 ms for 4 rows against 37 ms static. So each eligible step is padded to a bucket:
- batch: 1, 2, 4, 8, 16, 32, 64 requests (padding requests attend to slot 0 and write to the scratch
  block, `kv_cache.scratch_slot`, which nobody reads);
- window: every request has the same number of rows (1 for decode, S+1 for a chain, N for a tree);
- context: the KV positions gathered per request, 256 · 2^k (a padded position is masked out).
Prefill chunks, mixed windows (some requests decode while others verify), capture and the Triton backend
stay eager: prefill is compute-bound, and the rest are rarer shapes than graphs are worth.

The EAGLE-3 head has graphs of its own (`DraftGraphs`). A greedy step where every request drafts a chain is one
graph: the head's extension over each request's committed rows, padded to a window of 1, 4 or 8 rows (the rows
a step commits change every step, the window does not), then the whole chain, whose KV stays inside the graph
(tsengine/spec/chain_kv.py: the extension is the graph's one cache write). Measured at batch 1 with the int8
head, chain of 3: 4.7 → 3.7 ms of drafting per step against one graph per chain step (docs/benchmarks.md,
"One graph for the draft"). After an extension that runs eagerly (it fits no graph, or some request does
not draft) the chain alone is a graph. The extension alone is one only opt-in (`TSENGINE_EXTEND_GRAPHS=1`,
for trees and sampled rows): it showed no gain (chain 1 at 16 requests: 0.83× plain with it, 0.85× before).
The one-graph draft brings back what issue 15 blamed it for: more shapes (batch × window × context × chain
length) that compile lazily, which stalled an adaptive server's timed rounds (docs/benchmarks.md); the
heat rule below keeps rare ones eager.

Graphs compile lazily, once their shape is hot (`Heat`: its `HOT_AFTER`-th step within `HOT_WINDOW` graph
steps; until then it runs eagerly), and are logged with their compile time; torch's FX graph cache keeps
them on disk, so a restart recompiles a known shape in seconds, not ~40 s. Why not on the first step: a
compile stalls every request in the batch for ~40 s, and a shape met once (an adaptive server's exploration
step, one step in 128 at 16 requests) never earns that back: compiled on first sight, exploration stalled
two of three timed rounds of a 16-request benchmark (7.8 and 71.7 tok/s against 132 without a compile,
docs/benchmarks.md). A shape a fixed configuration runs is hot after two eager steps. On CUDA the
same static step is what a CUDA graph would capture; that path is unmeasured (no GPU has run it) and off.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import astuple, dataclass

import torch

from tsengine.context import Context
from tsengine.graph_compiler import compile_step
from tsengine.kv_cache import scratch_slot, slot
from tsengine.linear import compiled_packed_ops

log = logging.getLogger("tsengine")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
EXTEND_WINDOWS = (1, 4, 8)  # committed rows per request the head's extension pads to (a chain of 3 commits 1-4)
MIN_CONTEXT = 256
HOT_AFTER = 3  # a shape compiles on its third step within HOT_WINDOW graph-eligible steps
HOT_WINDOW = 64
_compiles = 0  # graphs compiled (or loaded from torch's cache) in this process


def compiles() -> int:
    """How many graphs this process has compiled so far: a step that compiled one took seconds, not
    milliseconds, so timing consumers (the adaptive policy's cost model) skip it."""
    return _compiles


@dataclass(frozen=True)
class Shape:
    batch: int  # requests, padded to a bucket
    window: int  # rows per request
    context: int  # KV positions gathered per request (a multiple of the block size)
    tree: bool  # verify windows are trees (bitmask attention)

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.window}{' tree' if self.tree else ''} ctx {self.context}"


class Heat:
    """Which shapes are worth a compile: those met `after` times within the last `window` graph-eligible
    steps (the clock ticks once per target step that fits a graph). One per engine, shared by the target's
    and the head's graphs, so both count in target steps."""

    def __init__(self, after: int = HOT_AFTER, window: int = HOT_WINDOW):
        self.after, self.window, self.clock = after, window, 0
        self._seen: dict[object, list[int]] = {}

    def tick(self) -> None:
        self.clock += 1

    def hot(self, key) -> bool:
        """Records one step of `key`'s shape; True once it has been met `after` times lately."""
        recent = [t for t in self._seen.get(key, ()) if self.clock - t < self.window] + [self.clock]
        self._seen[key] = recent[-self.after:]
        return len(recent) >= self.after


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


def static_step(model, kv, block_size: int, window: int, ids, positions, slots, tables, lens, tree_start, tree_anc,
                last=None):
    """The traced function: a uniform [B, window] batch over a [B, context / block_size] block table. Returns
    every row's final hidden state, aux features and logits (all rows of such a step draw a token; with
    `last`, only those rows': the prefill-chunk probe, bench/prefill_graph.py)."""
    b = tables.shape[0]
    seq = torch.arange(b, device=ids.device).repeat_interleave(window)
    ctx = Context(positions, seq, slots, tables, lens, torch.arange(b + 1, device=ids.device) * window, window,
                  tables.shape[1] * block_size, exact_ctx=False, uniform=True, tree_start=tree_start, tree_anc=tree_anc)
    hidden, aux = model(ids, ctx, kv)
    return hidden, aux, model.logits(hidden if last is None else hidden[last])


class CompiledSteps:
    """The graph bank of one engine: which steps fit a graph, the padding, and the lazy compile."""

    def __init__(self, model, kv: list, block_size: int, max_positions: int):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.scratch = scratch_slot(kv)
        top = -(-max_positions // block_size) * block_size
        contexts, c = [], MIN_CONTEXT
        while c < top:
            contexts, c = contexts + [c], 2 * c
        self.contexts = tuple(contexts + [top])
        self.graphs: dict[Shape, object] = {}
        self.compile_seconds: dict[Shape, float] = {}
        self.heat = Heat()
        self.steps = 0  # steps run through a graph (the rest ran eagerly)
        # one graph per shape, and never a dynamic one: a shape change is a new graph, not a recompile of the
        # last one with symbolic sizes (slower, above)
        self.packed_ops = compiled_packed_ops()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)

    def shape_for(self, batch, ctx: Context, tree: bool) -> Shape | None:
        """The graph shape this step pads to, or None when it runs eagerly (see the module docstring)."""
        window = batch[0].num_tokens
        if any(s.num_tokens != window or (window > 1 and not s.verify) or s.seq.capture is not None for s in batch):
            return None
        size, context = _bucket(len(batch), BATCH_BUCKETS), _bucket(ctx.max_ctx, self.contexts)
        if size is None or context is None:
            return None
        return Shape(size, window, context, tree)

    def ready(self, shape: Shape) -> bool:
        """Whether this step runs through `shape`'s graph: compiled already, or hot enough to compile now.
        Ticks the clock: call it once per step that fits a graph."""
        self.heat.tick()
        return shape in self.graphs or self.heat.hot(shape)

    def forward(self, shape: Shape, input_ids: torch.Tensor, ctx: Context):
        """(hidden, aux, logits) of the real rows: the step padded to `shape`, run through its graph."""
        b, w = ctx.block_tables.shape[0], shape.window
        pad = (shape.batch - b) * w

        def rows(x: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([x, x.new_full((pad,), fill)]) if pad else x

        tables = ctx.block_tables.new_zeros(shape.batch, shape.context // self.block_size)
        width = min(ctx.block_tables.shape[1], tables.shape[1])  # blocks held past max_ctx are never read
        tables[:b, :width] = ctx.block_tables[:, :width]
        lens = torch.cat([ctx.context_lens, ctx.context_lens.new_ones(shape.batch - b)])
        tree = (rows(ctx.tree_start, 0), rows(ctx.tree_anc, 1)) if shape.tree else (None, None)
        global _compiles
        graph, t0 = self.graphs.get(shape), time.perf_counter()
        if graph is None:
            _compiles += 1
            graph = self.graphs[shape] = compile_step(static_step, self.model, self.kv, self.block_size,
                                                      shape.window, key=astuple(shape))
        hidden, aux, logits = graph(rows(input_ids, 0), rows(ctx.positions, 0), rows(ctx.slot_mapping, self.scratch),
                                    tables, lens, *tree)
        if shape not in self.compile_seconds:  # its first call compiled it (or loaded it from torch's cache)
            self.compile_seconds[shape] = time.perf_counter() - t0
            log.info("compiled the %s step graph in %.1f s", shape.name, self.compile_seconds[shape])
        self.steps += 1
        n = b * w
        return hidden[:n], None if aux is None else aux[:n], logits[:n]


def chain_step(proposer, steps, hidden, pos, tables):
    """The traced greedy chain: [D, steps] drafts from the head's outputs `hidden` [D, H] at draft positions
    `pos` [D] (`Eagle3Proposer.greedy_chain`). The whole chain is one graph: its KV stays in the graph
    (tsengine/spec/chain_kv.py), so nothing is written twice."""
    return proposer.greedy_chain(hidden, pos, tables, steps)


def extend_step(proposer, window, ids, aux, positions, slots, tables, lens):
    """The traced extension: the head's layer over a uniform [B, window] batch of committed rows fed with
    the target's features `aux` [B·window, 3H] (`Eagle3Proposer.propose`). Returns [B·window, H] outputs."""
    b, dev = tables.shape[0], ids.device
    ctx = Context(positions, torch.arange(b, device=dev).repeat_interleave(window), slots, tables, lens,
                  torch.arange(b + 1, device=dev) * window, window, tables.shape[1] * proposer.block_size,
                  exact_ctx=False, uniform=True)
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
        self.compile_seconds: dict[tuple, float] = {}

    def _graph(self, key: tuple, fn, *bound):
        """`key`'s graph, compiled now if it is hot; None while it is not (the caller runs eagerly)."""
        global _compiles
        graph = self.graphs.get(key)
        if graph is None and self.heat.hot(key):
            _compiles += 1
            graph = self.graphs[key] = compile_step(fn, *bound, key=key)
        return graph

    def _call(self, key: tuple, what: str, graph, *inputs):
        t0 = time.perf_counter()
        out = graph(*inputs)
        if key not in self.compile_seconds:  # its first call compiled it (or loaded it from torch's cache)
            self.compile_seconds[key] = time.perf_counter() - t0
            log.info("compiled the %s graph %s in %.1f s", what, key, self.compile_seconds[key])
        return out

    def fits(self, runs) -> bool:
        """Whether the runs' extension fits a graph (`extend`, `extend_and_chain`)."""
        return self._shape(runs) is not None

    def _shape(self, runs) -> tuple[int, int, int] | None:
        """(batch bucket, window, context bucket) the runs pad to, or None."""
        window = _bucket(max(n for _, _, n in runs), EXTEND_WINDOWS)
        size = _bucket(len(runs), BATCH_BUCKETS)
        context = _bucket(max(start + n for _, start, n in runs), self.contexts)
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
        return self._call(key, "extension", graph, *inputs)[torch.tensor(real, device=aux.device)]

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
        return self._call(key, f"head extension (window {shape[1]}) and chain", graph, *inputs, last)[:len(runs)]

    def chain(self, steps: int, hidden, pos, tables):
        """[D, steps] greedy drafts from the head's outputs `hidden` [D, H] at draft positions `pos` [D]; None
        when the batch or its tables fit no bucket, or its graph is not hot yet."""
        d, bs = hidden.shape[0], self.proposer.block_size
        size, context = _bucket(d, BATCH_BUCKETS), _bucket(tables.shape[1] * bs, self.contexts)
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
        return self._call(key, "chain", graph, hidden, pos, padded)[:d]
