"""Automatic prefix caching: a request starts from the KV blocks an earlier request already computed for
the same tokens (vLLM's automatic prefix caching, SGLang's radix cache), in both caches, target and draft.

What a block's key carries, and why:
  - the parent block's key: a block's KV depends on every token before it, so keys chain from the start;
  - the block's own tokens;
  - the token after the block: the EAGLE-3 head's KV at position p is computed from the target's features
    at p and the embedding of token p + 1, so the draft KV of a block's last slot depends on the first
    token of the next block. Two prompts equal up to a block boundary and different right after it share
    the target KV of that block but not its last draft slot. With the token in the key, every slot of a
    hit block is valid in both caches and nothing is recomputed; without it, the last draft slot would be
    silently stale (tests/cache/test_prefix_cache.py::test_key_without_next_token_is_caught). Plain and NGRAM
    engines use the same key: it loses a hit only where two prompts diverge exactly at a boundary;
  - a salt naming the target, the head and the dtype (`salt`): one engine holds one of each today, but a
    key that could be confused across them would return another model's KV.

When a block gets its key: once it is full and complete in every cache the engine keeps (the target's
positions committed, and the head's extension over them done: `Sequence.draft_cached`), after the step's
commit and drafting, never at schedule time. A failed step therefore never leaves a key on unwritten KV.
One exception, head rows pending: adaptive speculation extends the head over a request's rows only when it
drafts for it, keeping their target features meanwhile (`Sequence.head_backlog`). When such a request
finishes, its blocks the head has not covered are keyed with those features kept beside them (`Pending`,
within `pending_bytes`, least recently used dropped first, their keys with them); a request that hits them
starts with the head behind (`draft_cached` at the first pending position) and the features as its
backlog, so the head catches up only if it drafts for it. Once a hitting request's head has covered a
pending block, the block is complete (`_settle`).

Requests for the same prefix that arrive together (n > 1 samples, or a burst with one system prompt): the
first computes it; the others wait in the queue while the next block they need is being computed by a
running request (`computing`), then start from the cached blocks. One prefill, then they diverge.

Requests that capture features (tsengine/engine/capture.py) compute every position and never start from a hit;
their blocks are still cached for others.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tsengine.cache.kv_cache import BlockManager
from tsengine.sequence import Backlog, Sequence

PENDING_SHARE, PENDING_MAX = 16, 256 << 20  # features kept for pending head rows: 1/16 of the KV cache, at most 256 MiB


def pending_bytes(kv: list) -> int:
    """The budget for target features kept with blocks whose head rows are pending (`Pending`): a row's
    features (three target layers) take about a seventh of its KV in SmolLM2's 30 layers, so 1/16 of the
    cache keeps pending rows for about 40% of its blocks."""
    return min(sum(k.nbytes + v.nbytes for k, v in kv) // PENDING_SHARE, PENDING_MAX)


def salt(*identity: str) -> bytes:
    """The root of every key chain: what the KV was computed by (target, head, dtype)."""
    return hashlib.blake2b("\0".join(identity).encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: list[int], next_token: int) -> bytes:
    """128-bit chained key of one full block (a collision would serve another prefix's KV)."""
    return hashlib.blake2b(parent + array("q", [*tokens, next_token]).tobytes(), digest_size=16).digest()


@dataclass
class Pending:
    """A keyed block whose head rows from `start` on are not computed: their target features."""

    start: int  # the block's first position the head has not covered
    features: torch.Tensor  # [block end - start, A]


class PrefixCache:
    def __init__(self, blocks: BlockManager, root: bytes, drafter_kv: bool, pending_bytes: int = 0):
        """`drafter_kv`: the proposer keeps per-position KV in the shared tables (EAGLE-3), so a block is
        complete only when the head has extended over it too. `pending_bytes`: the target features kept for
        blocks keyed with head rows pending (0: none are)."""
        self.blocks, self.root, self.drafter_kv = blocks, root, drafter_kv
        self.block_size = blocks.block_size
        self.computing_by: dict[bytes, int] = {}  # key -> sid of the running request computing that block
        self._promised: dict[int, tuple[int, int]] = {}  # sid -> [first, end) block indices it still promises
        self.queries = self.hits = 0  # prompt tokens looked up / found cached (counted at admission)
        self.pending: OrderedDict[bytes, Pending] = OrderedDict()  # front: dropped first
        self.pending_bytes, self.pending_size = pending_bytes, 0
        self._adopted: dict[int, tuple[int, int]] = {}  # sid -> [first, end) hit blocks with head rows pending

    def keys(self, seq: Sequence) -> list[bytes]:
        """The keys of `seq`'s full blocks whose next token is known (extended lazily; tokens only grow)."""
        keys, bs, tokens = seq.block_keys, self.block_size, seq.tokens
        while (len(keys) + 1) * bs < len(tokens):
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else self.root, tokens[i * bs:(i + 1) * bs], tokens[(i + 1) * bs]))
        return keys

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks of `seq`'s longest cached prefix (no references taken)."""
        if seq.capture is not None:
            return []
        hits, bs, behind = [], self.block_size, False
        for i, key in enumerate(self.keys(seq)):
            b, pending = self.blocks.cached(key), self.pending.get(key)
            # past a block with head rows pending, the head can catch up only over blocks wholly pending
            if b is None or (behind and (pending is None or pending.start != i * bs)):
                break
            behind = behind or pending is not None
            hits.append(b)
        return hits

    def computing(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether the next block `seq` would compute is being computed by a running request right now: then
        `seq` waits for it instead of computing it a second time."""
        keys = self.keys(seq)
        return len(hits) < len(keys) and self.computing_by.get(keys[len(hits)], seq.sid) != seq.sid

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """`seq` starts running from the cached blocks `hits` (its table is empty)."""
        seq.table = self.blocks.take(hits)
        seq.num_cached = seq.draft_cached = seq.num_keyed = len(hits) * self.block_size
        self.queries += len(seq.tokens)
        self.hits += seq.num_cached
        keys = self.keys(seq)
        pending = [(i, self.pending[k]) for i, k in enumerate(keys[:len(hits)]) if k in self.pending]
        if pending:  # the head starts behind: it catches up over the kept features if it drafts for `seq`
            start = pending[0][1].start
            features = [p.features for _, p in pending]
            seq.draft_cached = start
            seq.head_backlog = Backlog(start, features, seq.num_cached - start)
            self._adopted[seq.sid] = (pending[0][0], len(hits))
            for i, _ in reversed(pending):
                self.pending.move_to_end(keys[i])
        for key in keys[len(hits):]:
            self.computing_by.setdefault(key, seq.sid)
        if len(hits) < len(keys):
            self._promised[seq.sid] = (len(hits), len(keys))

    def commit(self, seq: Sequence) -> None:
        """Key `seq`'s blocks that became complete (full, in every cache, next token known)."""
        done = min(seq.num_cached, seq.draft_cached) if self.drafter_kv else seq.num_cached
        keys, bs = self.keys(seq), self.block_size
        for i in range(seq.num_keyed // bs, min(done // bs, len(keys), len(seq.table))):
            if self.blocks.set_key(seq.table[i], keys[i]):
                self._drop(keys[i])  # complete now: a pending entry left from an evicted block is stale
            seq.num_keyed = (i + 1) * bs
        self._settle(seq)
        # computed in the target: nobody waits on these any more (adaptive speculation keys a decode block only
        self._unpromise(seq, seq.num_cached // bs)  # once its head covers it: a waiting request must not wait for that)

    def _unpromise(self, seq: Sequence, upto: int) -> None:
        """Drop `seq`'s promises for its blocks below index `upto`."""
        first, end = self._promised.get(seq.sid, (0, 0))
        if first >= min(upto, end):
            return
        for key in seq.block_keys[first:min(upto, end)]:
            if self.computing_by.get(key) == seq.sid:
                del self.computing_by[key]
        if upto >= end:
            del self._promised[seq.sid]
        else:
            self._promised[seq.sid] = (upto, end)

    def release(self, seq: Sequence, keep: bool = True) -> None:
        """Before `seq`'s blocks are released (finished, aborted, preempted): key what is complete (unless its
        KV is suspect: `keep` False), and stop promising the blocks it was computing."""
        if keep:
            self.commit(seq)
            self._keep_pending(seq)
        self._unpromise(seq, len(seq.block_keys))
        self._adopted.pop(seq.sid, None)
        seq.num_keyed = 0

    def _keep_pending(self, seq: Sequence) -> None:
        """Key `seq`'s full blocks past what `commit` keyed, whose head rows are pending, with their kept
        target features (`Sequence.head_backlog`, from `draft_cached` to `num_cached`). Caught up at finish
        instead, every finished request paid a head pass that only a next turn of its conversation used."""
        backlog, bs = seq.head_backlog, self.block_size
        if (not self.pending_bytes or backlog is None or not backlog.rows
                or (backlog.start, backlog.end) != (seq.draft_cached, seq.num_cached)):
            return
        first, end = seq.num_keyed // bs, min(seq.num_cached // bs, len(self.keys(seq)), len(seq.table))
        if first >= end:
            return
        features = torch.cat(backlog.parts)
        for i in reversed(range(first, end)):  # its last block nearest the front: dropped first
            key = seq.block_keys[i]
            if self.blocks.set_key(seq.table[i], key):
                self._drop(key)
                start = max(i * bs, backlog.start)
                kept = Pending(start, features[start - backlog.start:(i + 1) * bs - backlog.start].clone())
                self.pending[key] = kept
                self.pending_size += kept.features.nbytes
        seq.num_keyed = end * bs
        while self.pending_size > self.pending_bytes:  # least recently used first, its key with it
            key, dropped = self.pending.popitem(last=False)
            self.pending_size -= dropped.features.nbytes
            self.blocks.forget(key)

    def _settle(self, seq: Sequence) -> None:
        """Hit blocks with head rows pending that `seq`'s head has covered since are complete (the head's
        KV is written in the shared block itself)."""
        first, end = self._adopted.get(seq.sid, (0, 0))
        upto = min(seq.draft_cached // self.block_size, end)
        if first >= upto:
            return
        for i in range(first, upto):
            if self.blocks.cached(seq.block_keys[i]) == seq.table[i]:
                self._drop(seq.block_keys[i])
        if upto >= end:
            del self._adopted[seq.sid]
        else:
            self._adopted[seq.sid] = (upto, end)

    def _drop(self, key: bytes) -> None:
        kept = self.pending.pop(key, None)
        if kept is not None:
            self.pending_size -= kept.features.nbytes
