"""What a request asks of sampling, validated where it is made (one record every layer reads).

The draws themselves, keyed by (seed, position) so speculation and batching never change them, are in
`tsengine/sample/sampling.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tsengine.errors import fail_if

GREEDY_BELOW = 1e-5  # temperatures under this are greedy: logits / 1e-40 overflow float32 to inf, then NaN
MAX_TOP_K = 2**31 - 1  # a top_k above any vocab means "off"; the bound keeps it a representable int64
MAX_TOKEN_ID = 2**31 - 1


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        problems = []
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            problems.append(f"temperature is {self.temperature!r}; must be a finite number >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p is {self.top_p!r}; must be in (0, 1]")
        if not (isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K):
            problems.append(f"top_k is {self.top_k!r}; must be -1, 0 (off) or a positive integer <= {MAX_TOP_K}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            problems.append(f"min_p is {self.min_p!r}; must be in [0, 1]")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            problems.append(f"max_tokens is {self.max_tokens!r}; must be an integer >= 1")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63):
            problems.append(f"seed is {self.seed!r}; must be an integer in -2**63..2**63-1")
        if not (isinstance(self.n, int) and 1 <= self.n <= 128):
            problems.append(f"n is {self.n!r}; must be an integer in 1..128")
        if not all(isinstance(t, int) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be integers in 0..{MAX_TOKEN_ID}")
        fail_if(problems, "invalid sampling parameters")
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < GREEDY_BELOW:  # vLLM's rule too; filters are meaningless at greedy
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
