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

Graphs compile lazily, on the first step of their shape, and are logged with their compile time; torch's
FX graph cache keeps them on disk, so a restart recompiles a known shape in seconds, not ~40 s. On CUDA the
same static step is what a CUDA graph would capture; that path is unmeasured (no GPU has run it) and off.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from tsengine.context import Context
from tsengine.kv_cache import scratch_slot
from tsengine.linear import compiled_packed_ops

log = logging.getLogger("tsengine")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_CONTEXT = 256
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


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


def static_step(model, kv, block_size: int, window: int, ids, positions, slots, tables, lens, tree_start, tree_anc):
    """The traced function: a uniform [B, window] batch over a [B, context / block_size] block table. Returns
    every row's final hidden state, aux features and logits (all rows of such a step draw a token)."""
    b = tables.shape[0]
    seq = torch.arange(b, device=ids.device).repeat_interleave(window)
    ctx = Context(positions, seq, slots, tables, lens, torch.arange(b + 1, device=ids.device) * window, window,
                  tables.shape[1] * block_size, exact_ctx=False, uniform=True, tree_start=tree_start, tree_anc=tree_anc)
    hidden, aux = model(ids, ctx, kv)
    return hidden, aux, model.logits(hidden)


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
            fn = functools.partial(static_step, self.model, self.kv, self.block_size, shape.window)
            graph = self.graphs[shape] = torch.compile(fn, fullgraph=True, dynamic=False,
                                                       options={"cpp_wrapper": True})
        hidden, aux, logits = graph(rows(input_ids, 0), rows(ctx.positions, 0), rows(ctx.slot_mapping, self.scratch),
                                    tables, lens, *tree)
        if shape not in self.compile_seconds:  # its first call compiled it (or loaded it from torch's cache)
            self.compile_seconds[shape] = time.perf_counter() - t0
            log.info("compiled the %s step graph in %.1f s", shape.name, self.compile_seconds[shape])
        self.steps += 1
        n = b * w
        return hidden[:n], None if aux is None else aux[:n], logits[:n]


def draft_step(proposer, ids, hidden, pos, tables):
    """The traced draft step: the head's greedy next token and output for tokens `ids` [D] fed with `hidden`
    [D, H] at draft positions `pos` [D] (one step of `Eagle3Proposer._extend_and_draft`'s chain). One step
    per graph, not the whole loop: a graph that writes the same cache twice makes inductor copy the whole
    cache (14 ms for two steps of SmolLM2's head, measured), one write per graph stays in place."""
    hidden = proposer._layer(ids, hidden, Context.one_each(tables, pos, proposer.block_size))
    return proposer.draft_ids_in_target[proposer.head.logits(hidden).float().argmax(-1)], hidden


class DraftGraphs:
    """The head's greedy chain steps after the first, one graph per (batch bucket, context bucket). Padding
    requests draft into the scratch block of the draft cache, whose block id fills their tables."""

    def __init__(self, proposer, contexts: tuple[int, ...]):
        self.proposer, self.contexts = proposer, contexts
        self.scratch_block = scratch_slot([proposer.kv]) // proposer.block_size
        self.graphs: dict[tuple[int, int], object] = {}
        self.compile_seconds: dict[tuple[int, int], float] = {}

    def chain(self, steps: int, first, hidden, pos, tables):
        """[D, steps + 1] draft ids: `first` and `steps` more; None when the batch or its tables fit no bucket."""
        d, bs = first.shape[0], self.proposer.block_size
        size, context = _bucket(d, BATCH_BUCKETS), _bucket(tables.shape[1] * bs, self.contexts)
        if size is None or context is None:
            return None
        padded = tables.new_full((size, context // bs), self.scratch_block)
        padded[:d] = 0
        padded[:d, :tables.shape[1]] = tables
        pad = size - d
        if pad:
            first, pos = torch.cat([first, first.new_zeros(pad)]), torch.cat([pos, pos.new_zeros(pad)])
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        global _compiles
        key = size, context
        graph = self.graphs.get(key)
        if graph is None:
            _compiles += 1
            graph = self.graphs[key] = torch.compile(functools.partial(draft_step, self.proposer), fullgraph=True,
                                                     dynamic=False, options={"cpp_wrapper": True})
        drafts = [first]
        for _ in range(steps):
            t0, pos = time.perf_counter(), pos + 1
            ids, hidden = graph(drafts[-1], hidden, pos, padded)
            drafts.append(ids)
            if key not in self.compile_seconds:
                self.compile_seconds[key] = time.perf_counter() - t0
                log.info("compiled the %d-request draft step graph (ctx %d) in %.1f s", size, context,
                         self.compile_seconds[key])
        return torch.stack(drafts, dim=1)[:d]
