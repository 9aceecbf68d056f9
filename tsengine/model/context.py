"""The one small object a forward needs besides the tokens: where each token sits and where its KV goes.

A step's tokens from every request are concatenated into one flat batch (prefill chunks, verify windows
and decode tokens mixed). Attention then needs, per token, its absolute position and its request; per
request, the block table and the KV length after this step's writes. Shapes that size padded buffers
(`max_q`, `max_ctx`) are host ints the scheduler already knows, so no kernel launch waits on a sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tsengine.cache.kv_cache import slot


def _long(x: list[int], device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)


def _group(reqs: list[int], runs, starts: list[int], lens: list[int]) -> tuple:
    """Host bookkeeping of one group of requests (see `Context.groups`)."""
    rows, seq, qstart = [], [], [0]
    for i, b in enumerate(reqs):
        n = runs[b][2]
        rows.extend(range(starts[b], starts[b] + n))
        seq.extend([i] * n)
        qstart.append(qstart[-1] + n)
    return rows, reqs, seq, qstart, max(runs[b][2] for b in reqs), max(lens[b] for b in reqs)


@dataclass(kw_only=True)
class Context:
    positions: torch.Tensor  # [T] long: absolute position of each token (RoPE and the causal limit)
    seq_index: torch.Tensor  # [T] long: which request (row of block_tables) each token belongs to
    slot_mapping: torch.Tensor  # [T] long: flat KV slot (block * block_size + offset) each token writes
    block_tables: torch.Tensor  # [B, M] long: the request's blocks in order (padding entries are 0)
    context_lens: torch.Tensor  # [B] long: KV length of each request once this step's tokens are written
    query_start: torch.Tensor  # [B + 1] long: offsets of each request's tokens in the flat batch
    max_q: int  # longest run of new tokens of one request
    max_ctx: int  # longest context_lens
    exact_ctx: bool = True  # max_ctx is the true longest context (False: an upper bound, see one_each)
    dense_base: int | None = None  # one request whose blocks are consecutive: its KV is slots base.. (a view)
    uniform: bool = False  # every request has max_q tokens, in request order ([B, max_q] rows; a compiled step)
    memo: dict = field(default_factory=dict)  # per-forward values every layer shares (the torch backend's plan)
    # Tree windows (None when the step has none). A token sees every KV index below its window's start and,
    # inside the window, the indices whose bit is set: itself and its ancestors. A plain token's window
    # starts at its own index with only its own bit, which is causal attention.
    tree_start: torch.Tensor | None = None  # [T] long: KV index where the token's window starts
    tree_anc: torch.Tensor | None = None  # [T] int64: visible window slots as bits (N ≤ 64)
    # A step mixing one-token runs (decodes) with longer ones (prefill chunks, verify windows): the two
    # groups as host lists (rows, request indices, request index of each row, query starts, max_q,
    # max_ctx), so that a backend that pads queries per request pads only the long runs, not every decode
    # to the chunk length. Only such a backend turns them into tensors (`parts`).
    groups: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @staticmethod
    def build(runs: list[tuple[list[int], int, list[int]]], block_size: int, device) -> "Context":
        """`runs`: per request (its block table, first new position, number of new tokens as a list
        of positions is implied: start..start+n-1). Host-side bookkeeping, once per step."""
        positions, seq_index, slots, starts, lens = [], [], [], [0], []
        width = max(len(bt) for bt, _, _ in runs)
        tables = []
        for b, (bt, start, n) in enumerate(runs):
            pos = range(start, start + n)
            positions.extend(pos)
            seq_index.extend([b] * n)
            slots.extend(slot(bt, p, block_size) for p in pos)
            starts.append(starts[-1] + n)
            lens.append(start + n)
            tables.append(bt + [0] * (width - len(bt)))

        def t(x):
            return _long(x, device)

        bt = runs[0][0]
        consecutive = len(runs) == 1 and bt == list(range(bt[0], bt[0] + len(bt)))
        ctx = Context(positions=t(positions), seq_index=t(seq_index), slot_mapping=t(slots), block_tables=t(tables),
                      context_lens=t(lens), query_start=t(starts), max_q=max(n for _, _, n in runs), max_ctx=max(lens),
                      dense_base=bt[0] * block_size if consecutive else None)
        ones = [b for b, (_, _, n) in enumerate(runs) if n == 1]
        if 1 < len(ones) < len(runs):
            longer = [b for b, (_, _, n) in enumerate(runs) if n > 1]
            ctx.groups = tuple(_group(reqs, runs, starts, lens) for reqs in (ones, longer))
        return ctx

    def parts(self) -> list[tuple[torch.Tensor, "Context"]]:
        """(flat rows, sub-context) per group of `groups`; built once per forward (after `set_trees`), so
        each sub-context's own memo serves every layer."""
        if "parts" not in self.memo:
            out, dev = [], self.positions.device
            for rows, reqs, seq, qstart, max_q, max_ctx in self.groups:
                rows, reqs, seq, qstart = (_long(x, dev) for x in (rows, reqs, seq, qstart))
                tree = ({} if self.tree_anc is None
                        else {"tree_start": self.tree_start[rows], "tree_anc": self.tree_anc[rows]})
                out.append((rows, Context(positions=self.positions[rows], seq_index=seq,
                                          slot_mapping=self.slot_mapping[rows], block_tables=self.block_tables[reqs],
                                          context_lens=self.context_lens[reqs], query_start=qstart, max_q=max_q,
                                          max_ctx=max_ctx, **tree)))
            self.memo["parts"] = out
        return self.memo["parts"]

    def set_trees(self, rows: torch.Tensor, start: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor) -> None:
        """Turn runs built by `build` into tree windows: `rows` [W, N] flat token indices of each window,
        `start` [W] its first KV index, `depths`/`anc` [W, N]. Position follows depth, slot follows node
        index: RoPE and the draws see prefix length + depth, while the KV keeps the slot `build` gave it."""
        self.tree_start = self.positions.clone()
        self.tree_anc = torch.ones_like(self.positions)
        self.positions = self.positions.clone()
        self.positions[rows] = start[:, None] + depths
        self.tree_start[rows] = start[:, None].expand_as(rows)
        self.tree_anc[rows] = anc
        self.memo.clear()

    @staticmethod
    def lanes(block_tables: torch.Tensor, positions: torch.Tensor, kv_index: torch.Tensor, start: torch.Tensor,
              anc: torch.Tensor, block_size: int) -> "Context":
        """A draft-tree step: K nodes per request ([D, K] positions, KV indices and bits; `start` [D]), built
        on the device. `max_ctx` is the table width, an upper bound."""
        d, k = positions.shape
        seq = torch.arange(d, device=positions.device)[:, None].expand(d, k)
        slots = block_tables[seq, kv_index // block_size] * block_size + kv_index % block_size
        flat = lambda x: x.reshape(-1).contiguous()  # noqa: E731  (an expanded [1, K] flattens to stride 0)
        return Context(positions=flat(positions), seq_index=flat(seq), slot_mapping=flat(slots),
                       block_tables=block_tables, context_lens=kv_index.amax(1) + 1,
                       query_start=torch.arange(d + 1, device=positions.device) * k, max_q=k,
                       max_ctx=block_tables.shape[1] * block_size, exact_ctx=False,
                       tree_start=flat(start[:, None].expand(d, k)), tree_anc=flat(anc))

    @staticmethod
    def one_each(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> "Context":
        """One new token per request at `positions` [B], built on the device. `max_ctx` is the table width,
        an upper bound. The draft chain wrote its steps' KV to the paged cache this way before it kept them
        beside it (tsengine/speculative/chain_kv.py); its tests still check the chain against that."""
        b = positions.shape[0]
        ar = torch.arange(b, device=positions.device)
        slots = block_tables[ar, positions // block_size] * block_size + positions % block_size
        return Context(positions=positions, seq_index=ar, slot_mapping=slots, block_tables=block_tables,
                       context_lens=positions + 1, query_start=torch.arange(b + 1, device=positions.device), max_q=1,
                       max_ctx=block_tables.shape[1] * block_size, exact_ctx=False)
