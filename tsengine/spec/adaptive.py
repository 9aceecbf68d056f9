"""Adaptive speculation: every step, the EAGLE-3 draft length k (0 = plain decoding .. S) that maximises the
measured tokens per second of the next step.

Measured online, while serving:
  acceptance  for each draft position i, over the verify steps that drafted it, how often the first i
              drafts were all accepted (`Acceptance`). A window of k drafts then commits
              tokens(k) = 1 + a_1 + ... + a_k per request (the bonus token plus the accepted run).
  cost        the target's step time as a + b·decode rows + c·prefill rows (a prefill row costs less: one
              weight read serves many rows; one slope for both made verify windows look cheap), and
              the drafter's as d + e·B + f·k + g·k·B
              (B requests drafting k tokens each), both fitted by recursive least squares that forget
              old steps (`LinearCost`), so the model follows the load and the machine.

The choice for B decoding requests: k* = argmax_k B·tokens(k) / (target(B·(k+1)) + draft(B, k)). Speculation
that does not pay on this machine at this load picks k = 0, which is plain decoding plus the head's one-layer
extension over the committed rows (kept up so that drafting can resume at any step). Exploration keeps the
estimates alive: the first S+1 steps try every k once, then one step in `explore_every` (32) tries a
neighbour of the best k, picked by a seeded generator (the decision, never the output, is random). Trying
any k uniformly cost ~10% at high load, where the best is plain decoding and most other k cost 2-4×.

Lossless by construction: whatever k is chosen, the target verifies (k = 0: it simply samples), so the output
is plain decoding's: greedy token for token, seeded sampling identical (tests/test_adaptive.py forces
random decisions through `AdaptiveProposer.choose`).
"""

from __future__ import annotations

import random
import time

import torch

from tsengine.spec.drafts import Drafts, Proposal


class LinearCost:
    """y ≈ θ·x by recursive least squares with forgetting factor `forget` (older steps weigh less)."""

    def __init__(self, features: int, forget: float = 0.98, prior: float = 1e3):
        self.theta = torch.zeros(features, dtype=torch.float64)
        self.p = torch.eye(features, dtype=torch.float64) * prior
        self.forget, self.samples = forget, 0

    def update(self, x: list[float], y: float) -> None:
        x = torch.tensor(x, dtype=torch.float64)
        px = self.p @ x
        gain = px / (self.forget + x @ px)
        self.theta += gain * (y - x @ self.theta)
        self.p = (self.p - torch.outer(gain, px)) / self.forget
        self.samples += 1

    def predict(self, x: list[float]) -> float:
        return max(float(torch.tensor(x, dtype=torch.float64) @ self.theta), 0.0)


class Acceptance:
    """a_i: P(the first i drafts are accepted | i were drafted), with a weak prior of 1/2."""

    def __init__(self, steps: int, prior: float = 2.0):
        self.hit, self.tried = [prior / 2] * steps, [prior] * steps

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(drafted):
            self.tried[i] += 1
            self.hit[i] += i < accepted

    def rates(self) -> list[float]:
        return [h / t for h, t in zip(self.hit, self.tried)]

    def tokens(self, k: int) -> float:
        """Expected tokens a window of k drafts commits (the bonus token included)."""
        return 1.0 + sum(self.rates()[:k])


class AdaptiveProposer:
    """Wraps the EAGLE-3 chain proposer; `propose` drafts each step at the length `choose` picks."""

    def __init__(self, inner, max_steps: int, explore_every: int = 32, seed: int = 0):
        self.inner, self.max_steps, self.explore_every = inner, max_steps, explore_every
        self.acceptance = Acceptance(max_steps)
        self.target_cost = LinearCost(3)  # [1, decode rows, prefill rows] -> seconds of the step's target part
        self.draft_cost = LinearCost(4)  # [1, B, k, k·B] -> seconds of the drafter
        self.decisions, self.draft_len = 0, max_steps
        self.chosen = [0] * (max_steps + 1)  # how often each k was chosen
        self._rng = random.Random(seed)

    def throughput(self, k: int, batch: int) -> float:
        """Predicted tokens per second of a step where `batch` requests verify k drafts each."""
        seconds = self.target_cost.predict([1.0, batch * (k + 1), 0.0]) + self.draft_cost.predict(
            [1.0, batch, k, k * batch])
        return batch * self.acceptance.tokens(k) / max(seconds, 1e-9)

    def choose(self, batch: int) -> int:
        """The draft length for the next step of `batch` drafting requests (a test hook may replace it)."""
        self.decisions += 1
        n = self.max_steps + 1
        if self.decisions <= n:  # warm-up: every k once, so both cost models see every shape
            return self.decisions % n
        best = max(range(n), key=lambda k: self.throughput(k, batch))
        if self.decisions % self.explore_every == 0:  # a neighbour: cheap to try, and it keeps a_k alive
            return self._rng.choice([k for k in (best - 1, best + 1) if 0 <= k < n])
        return best

    def propose(self, proposal: Proposal) -> list[Drafts | None]:
        if proposal.target_seconds > 0:
            self.target_cost.update([1.0, proposal.decode_rows, proposal.prefill_rows], proposal.target_seconds)
        for c in proposal.runs:
            if c.verified is not None:
                self.acceptance.observe(*c.verified)
        need = proposal.drafting
        k = self.choose(len(need)) if need else 0
        t0 = time.perf_counter()
        drafts = self.inner.propose(proposal, steps=k)
        if need:
            if drafts and drafts[0] is not None:
                drafts[0].tokens.sum().item()  # a host sync, on purpose: the drafter's time must be measured
            self.draft_cost.update([1.0, len(need), k, k * len(need)], time.perf_counter() - t0)
            self.draft_len = k
            self.chosen[k] += 1
        return drafts if k > 0 else [None] * len(need)
