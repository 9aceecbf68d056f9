"""What adaptive speculation measures while serving: step costs as fitted lines, acceptance as running rates.

    LinearCost   seconds ≈ θ·features, recursive least squares with forgetting (older steps weigh less, so the
                 fit follows the machine and the load). Its covariance is capped: with forgetting alone, a
                 direction the data stops exciting (one batch size, one draft length for a while) inflates
                 without bound and the next unusual step swings θ; capped, the fit stays where it was.
    Acceptance   per draft position i, P(the first i+1 drafts are all accepted | i+1 were drafted), for one
                 source of drafts (the EAGLE-3 head, prompt lookup), across requests; counts are capped
                 so the rates follow drift.
    PerRequest   the same counts for one request, read shrunk towards the global rates: a request is
                 known by its own few steps only as far as they outweigh `shrink` steps of the average.
    MeanTokens   the mean tokens a tree window committed (a tree's acceptance has no per-position form).
    RunningMean  a decayed mean (the one-row step's seconds, which no line through the others predicts).
"""

from __future__ import annotations

import torch


class LinearCost:
    """y ≈ θ·x by recursive least squares with forgetting factor `forget`, covariance capped at `prior`."""

    def __init__(self, names: tuple[str, ...], forget: float = 0.995, prior: float = 1e3):
        self.names = names
        n = len(names)
        self.theta = [0.0] * n  # host floats: the policy evaluates dozens of candidates per step
        self._theta = torch.zeros(n, dtype=torch.float64)
        self.p = torch.eye(n, dtype=torch.float64) * prior
        self.forget, self.prior, self.samples = forget, prior, 0

    def update(self, x: list[float], y: float) -> None:
        x = torch.tensor(x, dtype=torch.float64)
        px = self.p @ x
        gain = px / (self.forget + x @ px)
        self._theta += gain * (y - x @ self._theta)
        self.p = self.p - torch.outer(gain, px)
        if float(self.p.diagonal().max()) * (1 / self.forget) <= self.prior:
            self.p = self.p / self.forget
        self.theta = self._theta.tolist()
        self.samples += 1

    def predict(self, x: list[float]) -> float:
        return max(sum(t * v for t, v in zip(self.theta, x)), 0.0)


class Acceptance:
    """a_i: P(the first i+1 drafts are accepted | i+1 were drafted), with a weak prior of `prior_rate`."""

    def __init__(self, steps: int, prior: float = 2.0, prior_rate: float = 0.5, cap: float = 2000.0):
        self.hit, self.tried = [prior * prior_rate] * steps, [prior] * steps
        self.cap, self.windows = cap, 0

    def observe(self, drafted: int, accepted: int) -> None:
        self.windows += 1
        for i in range(min(drafted, len(self.tried))):
            self.tried[i] += 1
            self.hit[i] += i < accepted
            if self.tried[i] > self.cap:  # keep the rate, forget the weight
                self.hit[i] *= 0.5
                self.tried[i] *= 0.5

    def rates(self) -> list[float]:
        return [h / t for h, t in zip(self.hit, self.tried)]

    def tokens(self, k: int) -> float:
        """Expected tokens a chain of k drafts commits (the bonus token included)."""
        return 1.0 + sum(self.rates()[:k])


class PerRequest:
    """One request's acceptance counts per source, read shrunk towards the global `Acceptance`."""

    def __init__(self, steps: int):
        self.head_gap = False  # the head skipped some of this request's positions: it cannot draft for it
        self.hit = {"eagle3": [0.0] * steps, "ngram": [0.0] * steps}
        self.tried = {"eagle3": [0.0] * steps, "ngram": [0.0] * steps}

    def observe(self, source: str, drafted: int, accepted: int) -> None:
        hit, tried = self.hit[source], self.tried[source]
        for i in range(min(drafted, len(tried))):
            tried[i] += 1
            hit[i] += i < accepted

    def tokens(self, source: str, k: int, overall: Acceptance, shrink: float = 4.0, bonus: float = 0.0) -> float:
        """Expected tokens of a chain of k drafts from `source` for this request. `bonus` (over √(1+tried))
        is optimism for a source the request has hardly tried: without it, a source that is poor on
        average would never be tried on the one request where it shines."""
        hit, tried, rates = self.hit[source], self.tried[source], overall.rates()
        return 1.0 + sum(min(1.0, (hit[i] + shrink * rates[i]) / (tried[i] + shrink) + bonus / (1 + tried[i]) ** 0.5)
                         for i in range(k))


class MeanTokens:
    """Mean tokens committed per window of one tree shape; `prior` pseudo-windows at `prior_tokens`."""

    def __init__(self, prior_tokens: float, prior: float = 2.0, cap: float = 2000.0):
        self.total, self.count, self.cap = prior_tokens * prior, prior, cap

    def observe(self, accepted: int) -> None:
        self.total += 1 + accepted
        self.count += 1
        if self.count > self.cap:
            self.total, self.count = self.total / 2, self.count / 2

    @property
    def mean(self) -> float:
        return self.total / self.count


class RunningMean:
    """A decayed mean (weight `weight` on the newest sample; 0 samples: None)."""

    def __init__(self, weight: float = 0.05):
        self.weight, self.value, self.samples = weight, None, 0

    def observe(self, x: float) -> None:
        self.samples += 1
        w = max(self.weight, 1 / self.samples)  # a plain mean until 1/weight samples
        self.value = x if self.value is None else self.value + w * (x - self.value)
