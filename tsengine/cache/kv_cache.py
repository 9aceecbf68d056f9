"""Paged KV cache: fixed-size blocks, a block table per request, reference-counted blocks.

The target's cache and the draft head's cache share one block table per request: a block id names the
same token positions in both, so allocation, rollback and preemption happen once. A draft position never
runs ahead of the target's window (drafts sit inside the slots reserved for the next verify), so a
request's blocks always cover both caches.

Reference counts let a block be shared (one owner per reference); `check` is the invariant the debug
mode runs after every step: every block is either free or referenced, counts equal the number of
tables holding the block, and nothing leaks.

Prefix caching (`tsengine/cache/prefix_cache.py` decides what a block's key is and when it is complete): a full
block may carry a key. When its last reference goes it stays on the free list with its KV and its key, at
the most-recently-used end, and a later request with the same key takes it back (`take`); blocks without a
key go to the front, so they are reused first. A keyed block is evicted (its key forgotten) only when
`grow` needs it: when no unkeyed free block is left.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tsengine.errors import UserError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: reused first
        self.key_of: dict[int, bytes] = {}  # block -> its prefix key (full, complete blocks only)
        self.block_of: dict[bytes, int] = {}  # prefix key -> the block holding it
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= len(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Make `table` cover `num_tokens` positions (caller checked `can_grow`). A keyed free block taken
        here is evicted: its key is forgotten before anything overwrites its KV."""
        need = self.blocks_for(num_tokens) - len(table)
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            assert self.ref[b] == 0
            key = self.key_of.pop(b, None)
            if key is not None:
                del self.block_of[key]
                self.evictions += 1
            self.ref[b] = 1
            table.append(b)

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks past what `num_tokens` positions need (rejected drafts' space)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def share(self, table: list[int]) -> list[int]:
        """A second table over the same blocks (one more reference each)."""
        for b in table:
            self.ref[b] += 1
        return list(table)

    def release(self, table: list[int]) -> None:
        """Last block first: a request's tail ends up nearer the front of the free list than its head, so
        of its cached blocks the tail is evicted first (the head is the likelier prefix of another request)."""
        while table:
            self._release(table.pop())

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released twice"
        if self.ref[b] == 0:
            self.free[b] = None
            if b not in self.key_of:
                self.free.move_to_end(b, last=False)

    # ---- prefix caching -------------------------------------------------------------------------------------
    def cached(self, key: bytes) -> int | None:
        return self.block_of.get(key)

    def can_take(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a table made of the cached blocks `hits` can then grow to `num_tokens` positions (a hit
        sitting on the free list stops being free when taken)."""
        idle = sum(1 for b in hits if self.ref[b] == 0)
        return self.blocks_for(num_tokens) - len(hits) <= len(self.free) - idle

    def take(self, hits: list[int]) -> list[int]:
        """A new table over cached blocks (one reference each; idle ones leave the free list)."""
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        return list(hits)

    def set_key(self, b: int, key: bytes) -> bool:
        """Key a full block whose KV is complete; whether it now holds the key. A key already held by another
        block (two requests computed the same prefix at once) stays with that block; this one stays unkeyed."""
        if b not in self.key_of and key not in self.block_of:
            self.key_of[b], self.block_of[key] = key, b
        return self.block_of.get(key) == b

    def forget(self, key: bytes) -> None:
        """Drop a key (what made its block reusable is gone); an idle block goes to the front of the free list."""
        b = self.block_of.pop(key, None)
        if b is not None:
            del self.key_of[b]
            if b in self.free:
                self.free.move_to_end(b, last=False)

    def check(self, tables: list[list[int]]) -> None:
        """Debug invariant: refcounts equal table membership; free blocks are exactly the unreferenced; the
        key maps are each other's inverse."""
        counts = [0] * self.num_blocks
        for t in tables:
            for b in t:
                counts[b] += 1
        assert counts == self.ref, "block reference counts differ from the tables that hold them"
        assert set(self.free) == {b for b in range(self.num_blocks) if self.ref[b] == 0}, "leaked or double-owned block"
        assert len(self.key_of) == len(self.block_of) and all(self.block_of[k] == b for b, k in self.key_of.items()), \
            "prefix keys and blocks disagree"


def bytes_per_block(block_size: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def slot(table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of KV index `position` of a request with block table `table`."""
    return table[position // block_size] * block_size + position % block_size


def allocate(num_blocks: int, block_size: int, layers: int, kv_heads: int, head_dim: int, dtype, device):
    """Per layer a (k, v) pair of [num_blocks + 1, block_size, kv_heads, head_dim] tensors. Separate tensors,
    not views of one buffer: a compiled step writes them in place, where a view of one buffer makes the
    compiler copy the whole buffer back every step (seconds per step for a cache of a few GB; measured:
    docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"). The extra
    block is scratch (`scratch_slot`): padding rows of a compiled step write there, and nobody reads it."""
    shape = (num_blocks + 1, block_size, kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(layers)]


def scratch_slot(kv: list) -> int:
    """The first slot of the scratch block `allocate` adds after the managed ones."""
    blocks, block_size = kv[0][0].shape[:2]
    return (blocks - 1) * block_size


def move_slots(kv: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the KV at flat slots `src` to slots `dst` in every layer, K and V (an accepted tree path moving
    into consecutive slots). `src` and `dst` may overlap: each gather completes before its scatter."""
    for cache in (c for pair in kv for c in pair):
        flat = cache.view(cache.shape[0] * cache.shape[1], -1)
        flat[dst] = flat[src]


def plan_blocks(budget_bytes: int, per_block: int, block_size: int, positions: int) -> int:
    """`positions`: the most one request holds (`startup.positions_per_request`); the cache fits at least one."""
    n = budget_bytes // per_block
    if n < -(-positions // block_size):
        raise UserError(f"the KV cache budget ({budget_bytes / 2**20:.1f} MiB) holds {n} blocks of {block_size} "
                        f"tokens; one request at max_model_len holds up to {positions} positions "
                        f"({-(-positions // block_size)} blocks, speculation included): raise the KV cache memory "
                        "or lower max_model_len")
    return n
