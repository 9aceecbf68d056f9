"""Counters the engine keeps (speculation acceptance, tokens, step time split) and its periodic log line."""

from __future__ import annotations

import logging
import time

from tsengine.model import compile_worker

log = logging.getLogger("tsengine")


class StepClock:
    """One step's time marks: started, verdicts in, outputs committed (and emitted), finished. A step that
    compiled a graph, or shared the cores with a compile, says nothing of its own cost: its target time
    reads 0 (unknown)."""

    def __init__(self):
        self.start, self._epoch = time.perf_counter(), compile_worker.epoch()
        self.verdicts = self.commit = self.start

    def verified(self) -> None:
        self.verdicts = time.perf_counter()

    def committed(self) -> None:
        self.commit = time.perf_counter()

    @property
    def target_seconds(self) -> float:
        return self.verdicts - self.start if compile_worker.quiet(self._epoch) else 0.0

    def finished(self) -> tuple[float, float, float]:
        """(forward, commit, draft) seconds: schedule to verdicts, the commit, the proposer and the rest."""
        return self.verdicts - self.start, self.commit - self.verdicts, time.perf_counter() - self.commit


class Stats:
    def __init__(self, spec_steps: int, log_every_s: float = 10.0):
        self.spec_steps = spec_steps
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.accepted_per_pos = [0] * spec_steps
        self.drafted_per_pos = [0] * spec_steps  # verify steps that drafted position i (adaptive: not all)
        self.requests_started = self.generated_tokens = self.steps = 0
        self.time_forward = self.time_commit = self.time_draft = 0.0
        self.log_every_s, self._last_log, self._window = log_every_s, time.monotonic(), [0, 0]
        self.describe_policy = None  # adaptive speculation's own summary for the log line, when it runs
        self.prefix = None  # the prefix cache (its token counters), when prefix caching is on

    def verified(self, accepted: int, drafted: int) -> None:
        """`drafted`: the chain's length (a tree counts its S steps, as vLLM counts num_spec_tokens)."""
        drafted = min(drafted, self.spec_steps)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        for i in range(drafted):
            self.drafted_per_pos[i] += 1

    def step(self, tokens: int, reqs: int, split: tuple[float, float, float]) -> None:
        """`split`: the step's (forward, commit, draft) seconds (`StepClock.finished`)."""
        self.steps += 1
        self.generated_tokens += tokens
        self.time_forward += split[0]
        self.time_commit += split[1]
        self.time_draft += split[2]
        self._window[0] += tokens
        self._window[1] += 1
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            dt = now - self._last_log
            rates = [f"{a / d:.2f}" for a, d in zip(self.accepted_per_pos, self.drafted_per_pos) if d]
            p = self.prefix
            log.info("Decode batch. #running-req: %d, gen throughput (token/s): %.1f, Decoded Tok/Iter: %.2f%s%s",
                     reqs, self._window[0] / dt, self._window[0] / max(1, self._window[1]),
                     f", accept len: {self.mean_acceptance_length:.2f}, acceptance per pos: {' '.join(rates)}"
                     if rates else "",
                     f", prefix cache hit rate: {p.hits / p.queries:.1%}" if p is not None and p.queries else "")
            if self.describe_policy is not None:
                log.info(self.describe_policy())
            self._last_log, self._window = now, [0, 0]

    @property
    def mean_acceptance_length(self) -> float:
        """τ over verify steps: (accepted drafts + bonus) per target forward."""
        return (self.num_accepted + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0
