"""Continuous batching: every step mixes verify/decode windows of running requests with prefill chunks.

Order of a step (vLLM V1's policy): running requests first, oldest first, each taking its decode window
(1 token, or 1 + S with speculation) or its next prefill chunk; then waiting requests are admitted while
the token budget, the request cap and the free blocks allow. When a running request cannot get blocks,
the newest running request is preempted (its blocks freed, recomputed later; seeded sampling keys by
position, so recompute gives the same tokens). A step never crashes for lack of blocks and never leaks.

With prefix caching (`tsengine/cache/prefix_cache.py`) a request is admitted from its longest cached prefix: its
table starts with the cached blocks and its first chunk starts after them. A request whose next block is
being computed by a running request waits (it skips its turn; the queue behind it goes on) until that
block is cached: n > 1 samples and bursts with one system prompt prefill it once.

Blocks reserved per request: `len(tokens) + reserve` positions (`startup.reserve_slots`: 2·S for a chain,
max(2·S, N) for a tree of N nodes, 0 without speculation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tsengine.cache.kv_cache import BlockManager
from tsengine.cache.prefix_cache import PrefixCache
from tsengine.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # first position forwarded (== seq.num_cached)
    num_tokens: int  # tokens of the prompt/prefix forwarded, or N for a verify window
    verify: bool  # a decode window (last token + drafts)
    samples: bool = False  # the target draws a token: a verify window or the chunk reaching the last token

    def __post_init__(self):  # fixed at schedule time: the commit appends tokens afterwards
        self.samples = self.verify or self.start + self.num_tokens == len(self.seq.tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int, window: int,
                 reserve: int, prefix: PrefixCache | None = None):
        """`window`: the largest verify window (N: the root plus the drafts), 1 without speculation; a step's
        windows are as long as its requests' drafts (adaptive speculation varies them step to step).
        `prefix`: the prefix cache, None when prefix caching is off."""
        self.blocks, self.max_num_seqs, self.budget = blocks, max_num_seqs, max_num_batched_tokens
        self.prefix = prefix
        self.window, self.reserve = window, reserve
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, only: Sequence | None = None) -> list[Scheduled]:
        """`only`: schedule that request alone (a suspect of a failed step: tsengine/engine/faults.py)."""
        if only is None:
            return self._schedule()
        running, waiting = self.running, self.waiting
        self.running = [only] if only in running else []
        self.waiting = deque([only]) if only in waiting else deque()
        try:
            return self._schedule()
        finally:  # the others keep their places; `only` keeps its own if it still runs
            ran = only in self.running
            self.running = ([s for s in running if s is not only or ran]
                            + ([only] if ran and only not in running else []))
            self.waiting = self.waiting + deque(s for s in waiting if s is not only)

    def _schedule(self) -> list[Scheduled]:
        out: list[Scheduled] = []
        budget = self.budget
        running, self.running = self.running, []
        queue = deque(running)
        window = None  # every verify window of a step has one size (Windows stacks them)
        while queue and budget > 0:
            seq = queue.popleft()
            if seq.decoding:
                if seq.drafts is not None and window not in (None, seq.drafts.tokens.numel() + 1):
                    seq.drafts = None  # drafted at another length (it waited a step): decode it plainly
                n = seq.drafts.tokens.numel() + 1 if seq.drafts is not None else 1
                if n > budget:
                    self.running.append(seq)  # keeps its place; decodes next step
                    continue
            else:
                n = min(len(seq.tokens) - seq.num_cached, budget)
            need = seq.num_cached + n + (self.reserve if seq.num_cached + n >= len(seq.tokens) else 0)
            while not self.blocks.can_grow(seq.table, need) and queue:
                self._preempt(queue.pop())
            if not self.blocks.can_grow(seq.table, need):
                self._preempt(seq)
                continue
            self.blocks.grow(seq.table, need)
            out.append(Scheduled(seq, seq.num_cached, n, seq.decoding and n > 1))
            if out[-1].verify:
                window = n
            self.running.append(seq)
            budget -= n
        self.running.extend(queue)  # not reached this step (budget spent): they keep their blocks
        deferred = []  # waiting for a block another request is computing: they keep their places
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            hits = self.prefix.lookup(seq) if self.prefix else []
            if self.prefix and self.prefix.computing(seq, hits):
                deferred.append(seq)
                continue
            start = len(hits) * self.blocks.block_size
            n = min(len(seq.tokens) - start, budget)
            need = start + n + (self.reserve if start + n == len(seq.tokens) else 0)
            if not self.blocks.can_take(hits, need):
                self.waiting.appendleft(seq)
                break
            if self.prefix:
                self.prefix.admit(seq, hits)
            self.blocks.grow(seq.table, need)
            seq.status = Status.RUNNING
            out.append(Scheduled(seq, start, n, False))
            self.running.append(seq)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return out

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.preempt()
        self.waiting.appendleft(seq)

    def preempt(self, seq: Sequence) -> None:
        """Drop a running request's KV: it is recomputed from its tokens (the same tokens: sampling is keyed)."""
        if seq in self.running:
            self.running.remove(seq)
            self._preempt(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free everything a finished or aborted request holds (running or waiting). A request stopped by
        an error leaves nothing in the prefix cache: its KV is suspect."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self._release(seq, keep=reason != "error")
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence, keep: bool = True) -> None:
        if self.prefix:
            self.prefix.release(seq, keep)
        self.blocks.release(seq.table)

    def cache_blocks(self, seqs: list[Sequence]) -> None:
        """After a step's commit and drafting: key the blocks that became complete (prefix caching)."""
        if self.prefix:
            for seq in seqs:
                if seq.status is Status.RUNNING:
                    self.prefix.commit(seq)

    def trim(self, seq: Sequence) -> None:
        """After a commit: keep only the blocks the next step can use (rejected drafts' blocks go back)."""
        self.blocks.shrink(seq.table, len(seq.tokens) + self.reserve)

    def check(self) -> None:
        """Debug invariant after every step: block ownership is exact; states are where they belong."""
        live = self.running + list(self.waiting)
        self.blocks.check([s.table for s in live])
        assert all(s.status is Status.RUNNING for s in self.running)
        assert all(s.status is Status.WAITING and not s.table for s in self.waiting)
        assert len({s.sid for s in live}) == len(live), "a request is queued twice"
        for s in self.running:
            assert self.blocks.blocks_for(s.num_cached) <= len(s.table), "cached positions outside the table"
        if self.prefix:  # a waiting request may wait on a block only while a running request computes it
            assert set(self.prefix.computing_by.values()) <= {s.sid for s in self.running}, "stale prefix promise"
