"""Per-request fault isolation: a step that raises because of one request's data stops that request alone.

A step is batched, so an exception in it (a parameter that slipped past validation, a bad tensor built from
one request's rows) does not say whose data caused it. Nothing is committed before the verdicts exist, so
a step that raises before the commit leaves every request exactly as it was: its drafts still stand, its
cached positions are unchanged, and the KV it wrote past them is overwritten next time. The engine then
puts the step's requests in quarantine and runs them one per step ("solo"). A solo step that raises names
its culprit, which finishes with reason "error"; a solo step that succeeds clears its request, which goes
back to ordinary batching. Sampling is keyed by (seed, position), so the requests that were retried get
the tokens they would have got without the bad request.

Failures that are not about one request's data fail the whole engine at once, as before, and say so:
running out of memory, or an accelerator error (the device state can no longer be trusted).
"""

from __future__ import annotations

from collections import deque

import torch

from tsengine.sequence import Sequence, Status

_ENGINE_WIDE: tuple[type[BaseException], ...] = tuple(
    t for t in (MemoryError, getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None))
    if t is not None)


def engine_wide(error: BaseException) -> bool:
    """A failure no single request caused: retrying requests one by one would only fail each of them."""
    return isinstance(error, _ENGINE_WIDE)


class EngineFault(RuntimeError):
    """An engine-wide failure: every open request is stopped (the server answers 503)."""


class Quarantine:
    """Requests from a failed step, retried one per step until each is cleared or found to be the cause."""

    def __init__(self):
        self.suspects: deque[Sequence] = deque()

    def solo(self) -> Sequence | None:
        """The request the next step runs alone, if any (finished suspects are dropped)."""
        while self.suspects and self.suspects[0].status is Status.FINISHED:
            self.suspects.popleft()
        return self.suspects[0] if self.suspects else None

    def add(self, seqs) -> None:
        for seq in seqs:
            if seq.status is not Status.FINISHED and seq not in self.suspects:
                self.suspects.append(seq)

    def release(self, seq: Sequence) -> None:
        if seq in self.suspects:
            self.suspects.remove(seq)

    def __len__(self) -> int:
        return len(self.suspects)


def failure_message(error: BaseException) -> str:
    """What the client is told: the cause class, never the exception text (it may hold internal state); the
    server log has the trace."""
    return (f"the engine could not process this request ({type(error).__name__}); it was stopped and no other "
            "request was affected")
