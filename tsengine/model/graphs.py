"""Compiled static-shape steps: one graph per (batch bucket, window, context bucket) for the target's decode
and verify steps, so the ~30 small eager ops per layer (norms, RoPE, KV writes, attention glue) fuse.

Why static shapes: on a small CPU about a third of an eager step is per-op overhead (measured:
docs/benchmarks-journal.md, "Engine decode speed (issue 4)"). Inductor fuses that away only with every
shape fixed: the same SmolLM2 step with dynamic batch and context ran slower at 4 rows than static buckets
(docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"). So each eligible step is padded to a bucket:
- batch: 1, 2, 4, 8, 16, 32, 64 requests (padding requests attend to slot 0 and write to the scratch
  block, `kv_cache.scratch_slot`, which nobody reads);
- window: every request has the same number of rows (1 for decode, S+1 for a chain, N for a tree);
- context: the KV positions gathered per request, 256 · 2^k (a padded position is masked out).
Prefill chunks, mixed windows (some requests decode while others verify), capture and the Triton backend
stay eager: prefill is compute-bound, and the rest are rarer shapes than graphs are worth.

The EAGLE-3 head's graphs (`tsengine/speculative/draft_graphs.py`) use the same compiler, buckets and `Heat`.

Graphs compile once their shape is hot (`Heat`: its `HOT_AFTER`-th step within `HOT_WINDOW` graph steps),
off the engine thread (tsengine/model/compile_worker.py): until a shape's graph is ready its steps run
eagerly, so no request waits for a compile. Why not every shape on sight: a shape met once (an adaptive
server's exploration step, one step in 128 at 16 requests) never earns its compile back, and a compile
shares the cores with the steps it would speed up (measured: docs/benchmarks-journal.md, "16 requests
through the server, after the age rule"). A shape a fixed configuration runs is hot after two eager steps.
The compiled code is cached on disk under the tsengine cache, so a restart loads a known shape in seconds.
On CUDA the same static step is what a CUDA graph would capture; that path is unmeasured (no GPU has run
it) and off.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from tsengine.cache.kv_cache import scratch_slot
from tsengine.model.compile_worker import WORKER, raise_recompile_limits, scratch_copy, use_persistent_cache
from tsengine.model.context import Context
from tsengine.model.graph_compiler import compile_step
from tsengine.model.linear import compiled_packed_ops

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_CONTEXT = 256
HOT_AFTER = 3  # a shape compiles on its third step within HOT_WINDOW graph-eligible steps
HOT_WINDOW = 64
# tokens one greedy request makes to heat every shape it runs (a verify step may commit several)
TOKENS_TO_HEAT = 3 * (HOT_AFTER + 1)


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


def bucket(n: int, buckets) -> int | None:
    """The smallest bucket that holds n, or None."""
    return next((b for b in buckets if b >= n), None)


def static_step(model, kv, block_size: int, window: int, ids, positions, slots, tables, lens, tree_start, tree_anc,
                last=None):
    """The traced function: a uniform [B, window] batch over a [B, context / block_size] block table. Returns
    every row's final hidden state, aux features and logits (all rows of such a step draw a token; with
    `last`, only those rows': the prefill-chunk probe, bench/prefill_graph.py)."""
    b = tables.shape[0]
    seq = torch.arange(b, device=ids.device).repeat_interleave(window)
    ctx = Context(positions=positions, seq_index=seq, slot_mapping=slots, block_tables=tables, context_lens=lens,
                  query_start=torch.arange(b + 1, device=ids.device) * window, max_q=window,
                  max_ctx=tables.shape[1] * block_size, exact_ctx=False, uniform=True, tree_start=tree_start,
                  tree_anc=tree_anc)
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
        self.heat = Heat()
        self.steps = 0  # steps run through a graph (the rest ran eagerly)
        # one graph per shape, and never a dynamic one: a shape change is a new graph, not a recompile of the
        # last one with symbolic sizes (slower, above)
        self.packed_ops = compiled_packed_ops()
        use_persistent_cache()
        raise_recompile_limits()

    def shape_for(self, batch, ctx: Context, tree: bool) -> Shape | None:
        """The graph shape this step pads to, or None when it runs eagerly (see the module docstring)."""
        window = batch[0].num_tokens
        if any(s.num_tokens != window or (window > 1 and not s.verify) or s.seq.capture is not None for s in batch):
            return None
        size, context = bucket(len(batch), BATCH_BUCKETS), bucket(ctx.max_ctx, self.contexts)
        if size is None or context is None:
            return None
        return Shape(size, window, context, tree)

    def forward(self, shape: Shape, input_ids: torch.Tensor, ctx: Context):
        """(hidden, aux, logits) of the real rows: the step padded to `shape`, run through its graph; None
        while that graph is not ready (its shape not hot yet, or compiling), and the caller runs eagerly.
        Ticks the heat clock: call it once per step that fits a graph."""
        self.heat.tick()
        graph = self.graphs.get(shape)
        if graph is None:
            if not self.heat.hot(shape):
                return None
            graph = self.graphs[shape] = compile_step(static_step, self.model, self.kv, self.block_size,
                                                      shape.window, key=astuple(shape))
        if graph.state not in ("new", "ready"):  # compiling, or failed to: eager
            return None
        b, w = ctx.block_tables.shape[0], shape.window
        pad = (shape.batch - b) * w

        def rows(x: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([x, x.new_full((pad,), fill)]) if pad else x

        tables = ctx.block_tables.new_zeros(shape.batch, shape.context // self.block_size)
        width = min(ctx.block_tables.shape[1], tables.shape[1])  # blocks held past max_ctx are never read
        tables[:b, :width] = ctx.block_tables[:, :width]
        lens = torch.cat([ctx.context_lens, ctx.context_lens.new_ones(shape.batch - b)])
        tree = (rows(ctx.tree_start, 0), rows(ctx.tree_anc, 1)) if shape.tree else (None, None)
        inputs = (rows(input_ids, 0), rows(ctx.positions, 0), rows(ctx.slot_mapping, self.scratch), tables, lens,
                  *tree)
        if graph.state == "new":  # its compile writes only the scratch slot
            WORKER.submit(graph, scratch_copy(inputs, 2, self.scratch), f"{shape.name} step")
            if not graph.ready:
                return None
        hidden, aux, logits = graph(*inputs)
        self.steps += 1
        n = b * w
        return hidden[:n], None if aux is None else aux[:n], logits[:n]
