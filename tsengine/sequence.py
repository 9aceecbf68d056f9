"""A request's state as the scheduler and the engine see it.

`tokens` holds prompt + output; `num_cached` positions of it have their KV (target and draft) committed.
A request decodes when everything but its last token is cached; until then it prefills in chunks. With
speculation, `drafts` holds what the proposer proposed for its next verify window (`spec.drafts.Drafts`:
device tensors the engine never reads on the host).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tsengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tsengine.engine.capture import CaptureBuffer
    from tsengine.speculative.drafts import Drafts
    from tsengine.speculative.ngram import NgramIndex

_ids = itertools.count()


@dataclass
class Backlog:
    """Target features of positions [start, start + rows) the EAGLE-3 head has not extended over yet.
    Adaptive speculation extends it over a request's rows only when it drafts for it (its plain steps pay
    no head upkeep: tsengine/speculative/adaptive/proposer.py), and the prefix cache keeps a finished
    request's backlog with its blocks, so a later hit catches the head up only when it is used
    (tsengine/cache/prefix_cache.py)."""

    start: int
    parts: list = field(default_factory=list)  # [rows, A] tensors of target features, in position order
    rows: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]
    params: SamplingParams
    seed: int
    prompt_len: int = 0
    sid: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    table: list[int] = field(default_factory=list)
    num_cached: int = 0
    drafts: "Drafts | None" = None
    capture: "CaptureBuffer | None" = None  # target features kept by position (tsengine/engine/capture.py)
    finish_reason: str | None = None
    num_preempted: int = 0
    verify_steps: int = 0
    accepted: int = 0  # draft tokens accepted in total
    ngram: "NgramIndex | None" = None  # prompt lookup's index of this request's tokens (NGRAM, adaptive)
    spec_stats: object = None  # adaptive speculation's acceptance counts for this request (adaptive/policy.py)
    draft_cached: int = 0  # positions [0, draft_cached) hold the EAGLE-3 head's committed KV (<= num_cached)
    head_backlog: "Backlog | None" = None  # target features of positions from draft_cached the head has yet to cover
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks (prefix_cache.py)
    num_keyed: int = 0  # positions whose blocks have their prefix-cache key

    def __post_init__(self):
        self.prompt_len = self.prompt_len or len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return self.num_cached == len(self.tokens) - 1 and self.num_output > 0

    def preempt(self) -> None:
        """Recompute later: KV dropped, the tokens so far become the prefix to prefill again."""
        self.status, self.num_cached, self.drafts = Status.WAITING, 0, None
        self.draft_cached = self.num_keyed = 0
        self.head_backlog = None
        self.num_preempted += 1
