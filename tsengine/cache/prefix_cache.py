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

Requests for the same prefix that arrive together (n > 1 samples, or a burst with one system prompt): the
first computes it; the others wait in the queue while the next block they need is being computed by a
running request (`computing`), then start from the cached blocks. One prefill, then they diverge.

Requests that capture features (tsengine/engine/capture.py) compute every position and never start from a hit;
their blocks are still cached for others.
"""

from __future__ import annotations

import hashlib
from array import array

from tsengine.cache.kv_cache import BlockManager
from tsengine.sequence import Sequence


def salt(*identity: str) -> bytes:
    """The root of every key chain: what the KV was computed by (target, head, dtype)."""
    return hashlib.blake2b("\0".join(identity).encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: list[int], next_token: int) -> bytes:
    """128-bit chained key of one full block (a collision would serve another prefix's KV)."""
    return hashlib.blake2b(parent + array("q", [*tokens, next_token]).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, blocks: BlockManager, root: bytes, drafter_kv: bool):
        """`drafter_kv`: the proposer keeps per-position KV in the shared tables (EAGLE-3), so a block is
        complete only when the head has extended over it too."""
        self.blocks, self.root, self.drafter_kv = blocks, root, drafter_kv
        self.block_size = blocks.block_size
        self.computing_by: dict[bytes, int] = {}  # key -> sid of the running request computing that block
        self._promised: dict[int, tuple[int, int]] = {}  # sid -> [first, end) block indices it still promises
        self.queries = self.hits = 0  # prompt tokens looked up / found cached (counted at admission)

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
        hits = []
        for key in self.keys(seq):
            b = self.blocks.cached(key)
            if b is None:
                break
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
        for key in keys[len(hits):]:
            self.computing_by.setdefault(key, seq.sid)
        if len(hits) < len(keys):
            self._promised[seq.sid] = (len(hits), len(keys))

    def commit(self, seq: Sequence) -> None:
        """Key `seq`'s blocks that became complete (full, in every cache, next token known)."""
        done = min(seq.num_cached, seq.draft_cached) if self.drafter_kv else seq.num_cached
        keys, bs = self.keys(seq), self.block_size
        for i in range(seq.num_keyed // bs, min(done // bs, len(keys), len(seq.table))):
            self.blocks.set_key(seq.table[i], keys[i])
            seq.num_keyed = (i + 1) * bs
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
        self._unpromise(seq, len(seq.block_keys))
        seq.num_keyed = 0
