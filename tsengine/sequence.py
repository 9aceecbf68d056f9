"""A request's state as the scheduler and the engine see it.

`tokens` holds prompt + output; `num_cached` positions of it have their KV (target and draft) committed.
A request decodes when everything but its last token is cached; until then it prefills in chunks. With
speculation, `drafts` holds the tokens proposed for its next verify window (a device tensor row: the
engine never reads them on the host).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from tsengine.capture import CaptureBuffer  # noqa: F401 (annotation)

from tsengine.sampling import SamplingParams

_ids = itertools.count()


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
    drafts: torch.Tensor | None = None
    tree: tuple | None = None  # (parents, depths, ancestor bits), each [N] on the device; None for a chain
    draft_q: torch.Tensor | None = None  # [S, draft vocab]: the drafts' distributions (rejection sampling only)
    capture: "CaptureBuffer | None" = None  # target features kept by position (tsengine/capture.py)
    finish_reason: str | None = None
    num_preempted: int = 0
    verify_steps: int = 0
    accepted: int = 0  # draft tokens accepted in total

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
        self.status, self.num_cached, self.drafts, self.tree, self.draft_q = Status.WAITING, 0, None, None, None
        self.num_preempted += 1
