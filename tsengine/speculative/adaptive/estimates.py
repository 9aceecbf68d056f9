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
    RunningMean  a decayed mean (a step shape's seconds: `StepCosts.step_seconds`).
    RecentMedian the median of the last few samples (the head's seconds per shape: a few eager steps among
                 them, before its graph compiles, leave it alone).
    Correction   per kind of step and batch size, what it delivered against what was predicted for it.
"""

from __future__ import annotations

import statistics
from collections import deque


class LinearCost:
    """y ≈ θ·x by recursive least squares with forgetting factor `forget`, covariance capped at `prior`.
    Host floats throughout: it is updated every step and read for dozens of candidate plans per step, and
    with at most four terms a tensor op's dispatch costs more than the arithmetic."""

    def __init__(self, names: tuple[str, ...], forget: float = 0.995, prior: float = 1e3):
        self.names = names
        n = len(names)
        self.theta = [0.0] * n
        self.p = [[prior if i == j else 0.0 for j in range(n)] for i in range(n)]  # the covariance
        self.forget, self.prior, self.samples = forget, prior, 0

    def update(self, x: list[float], y: float) -> None:
        p, theta = self.p, self.theta
        px = [sum(pij * xj for pij, xj in zip(row, x)) for row in p]
        gain = [v / (self.forget + sum(xi * v for xi, v in zip(x, px))) for v in px]
        err = y - sum(t * xi for t, xi in zip(theta, x))
        self.theta = [t + g * err for t, g in zip(theta, gain)]
        p = [[pij - gi * pxj for pij, pxj in zip(row, px)] for row, gi in zip(p, gain)]
        if max(p[i][i] for i in range(len(p))) / self.forget <= self.prior:
            p = [[v / self.forget for v in row] for row in p]
        self.p = p
        self.samples += 1

    def predict(self, x: list[float]) -> float:
        return max(sum(t * v for t, v in zip(self.theta, x)), 0.0)


class Acceptance:
    """a_i: P(the first i+1 drafts are accepted | i+1 were drafted), with a weak prior of `prior_rate`."""

    def __init__(self, steps: int, prior: float = 2.0, prior_rate: float = 0.5, cap: float = 2000.0):
        self.hit, self.tried = [prior * prior_rate] * steps, [prior] * steps
        self.cap, self.windows, self._rates = cap, 0, None

    def observe(self, drafted: int, accepted: int) -> None:
        self.windows, self._rates = self.windows + 1, None
        for i in range(min(drafted, len(self.tried))):
            self.tried[i] += 1
            self.hit[i] += i < accepted
            if self.tried[i] > self.cap:  # keep the rate, forget the weight
                self.hit[i] *= 0.5
                self.tried[i] *= 0.5

    def rates(self) -> list[float]:
        if self._rates is None:  # read for every request of every candidate plan: computed once per change
            self._rates = [h / t for h, t in zip(self.hit, self.tried)]
        return self._rates

    def tokens(self, k: int) -> float:
        """Expected tokens a chain of k drafts commits (the bonus token included)."""
        return 1.0 + sum(self.rates()[:k])


class PerRequest:
    """One request's acceptance counts per source, read shrunk towards the global `Acceptance`."""

    def __init__(self, steps: int):
        self.head_gap = False  # the head has a hole in this request's positions: it cannot draft for it
        self.age = 0  # decisions it has been part of (requests that started together have the same age)
        self.hit = {"eagle3": [0.0] * steps, "ngram": [0.0] * steps}
        self.tried = {"eagle3": [0.0] * steps, "ngram": [0.0] * steps}
        self._expected: dict[tuple, tuple[list[float], list[float]]] = {}  # `expected`, with the rates it read

    def observe(self, source: str, drafted: int, accepted: int) -> None:
        hit, tried = self.hit[source], self.tried[source]
        for i in range(min(drafted, len(tried))):
            tried[i] += 1
            hit[i] += i < accepted
        self._expected.clear()

    def tokens(self, source: str, k: int, overall: Acceptance, shrink: float = 4.0, bonus: float = 0.0) -> float:
        """Expected tokens of a chain of k drafts from `source` for this request. `bonus` (over √(1+tried))
        is optimism for a source the request has hardly tried: without it, a source that is poor on
        average would never be tried on the one request where it shines."""
        return self.expected(source, overall, shrink, bonus)[k]

    def expected(self, source: str, overall: Acceptance, shrink: float = 4.0, bonus: float = 0.0) -> list[float]:
        """`tokens` for k = 0, 1, ..., steps. Kept until this request's or the overall record changes: the
        policy reads it for every request of every candidate plan, every step, and on plain steps neither
        record changes."""
        rates = overall.rates()  # the same list object until the overall record changes
        key = source, shrink, bonus
        kept = self._expected.get(key)
        if kept is not None and kept[0] is rates:
            return kept[1]
        out = [1.0]
        for h, t, r in zip(self.hit[source], self.tried[source], rates):
            out.append(out[-1] + min(1.0, (h + shrink * r) / (t + shrink) + bonus / (1 + t) ** 0.5))
        self._expected[key] = rates, out
        return out


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


class Refills:
    """Whether a request that leaves the batch has its slot taken at once: the share of departures that an
    arrival followed within `within_s` (a client sending its next request as one ends), a decayed mean; no
    departure seen yet: not likely.

    Why: where the batch is refilled as it empties, a request done sooner frees its slot for the next one,
    and every token counts; where it is not, a batch that started together thins out before its slowest
    request ends (`MARGIN`, `_worth_ratio`). Ages alone cannot tell the two apart where requests are equally
    long: decoding plainly, four clients' requests end at the same step, their next ones start at the same
    step, and every wave looked like a batch that would thin out unrefilled. At 4 requests a server so
    judged decoded plainly on 95% of its steps and ran 0.81x the pinned chain of 1 (issue 43,
    docs/benchmarks.md "Eleventh run"). Time, not steps, bounds a refill: an engine idle between two bursts
    takes no steps, and a burst's first request is no refill."""

    def __init__(self, within_s: float = 1.0, weight: float = 0.1):
        self.within_s = within_s
        self.share = RunningMean(weight)
        self._present: set[int] = set()  # the last decision's requests (their records' ids) ...
        self._seen = 0.0  # ... and its time: a request missing now left after it
        self._open: list[float] = []  # when each departure not yet refilled left

    def observe(self, stats: list[PerRequest], now: float) -> None:
        """This decision's requests (their ages already counted: 1 is a newcomer) at time `now`."""
        arrived = [st for st in stats if st.age == 1]
        ids, new = {id(st) for st in stats}, {id(st) for st in arrived}
        self._open += [self._seen] * len(self._present - (ids - new))  # a newcomer may reuse a departed one's id
        self._present, self._seen = ids, now
        while self._open and now - self._open[0] > self.within_s:
            self._open.pop(0)
            self.share.observe(0.0)
        for _ in arrived[:len(self._open)]:
            self._open.pop(0)
            self.share.observe(1.0)

    @property
    def likely(self) -> bool:
        return self.share.value is not None and self.share.value >= 0.5


class RecentMedian:
    """The median of the last `window` samples (0 samples: None)."""

    def __init__(self, window: int = 15):
        self.recent: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    def observe(self, x: float) -> None:
        self.recent.append(x)
        self.value = statistics.median(self.recent)

    @property
    def samples(self) -> int:
        return len(self.recent)


class Correction:
    """Per (plan kind, batch bucket): realized / predicted tokens, as a ratio of decayed sums, from 1.

    A ratio of sums, not a mean of per-step ratios: one step of a chain commits 1 to k + 1 tokens, so its
    own ratio swings widely. A running mean of those (weight 0.15, the first revision) wandered by more than
    `MARGIN`, and a kind that drifted low stopped being chosen and stayed low (it learns only when chosen):
    at batch 1 every speculative kind sat well below 1 while its steps delivered more than plain's (measured:
    docs/benchmarks-journal.md, "With compiled step graphs (the default since issue 16)"). `prior`
    pseudo-steps at ratio 1 keep a barely tried kind near 1."""

    def __init__(self, weight: float = 0.02, prior: float = 4.0):
        self.weight, self.prior, self.sums = weight, prior, {}

    @property
    def ratio(self) -> dict:
        return {k: got / want for k, (got, want) in list(self.sums.items())}  # a copy: /metrics reads it

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()  # 1, 2, 4, 8, ... (the bucket's top)

    def observe(self, kind: str, batch: int, tokens: float, predicted_tokens: float) -> None:
        """`tokens` the step committed; `predicted_tokens` what the prediction promised in the step's time."""
        k = kind, self.bucket(batch)
        got, want = self.sums.get(k, (self.prior, self.prior))
        keep = 1 - self.weight
        self.sums[k] = (got * keep + tokens, want * keep + predicted_tokens)

    def __call__(self, kind: str, batch: int) -> float:
        """The ratio at this batch bucket, else at the nearest bucket this kind has one for (a load it has
        not run at yet is likelier to behave as the nearest load it has), else 1."""
        bucket = self.bucket(batch)
        sums = self.sums.get((kind, bucket))
        if sums is None:
            known = [b for (n, b) in self.sums if n == kind]
            if not known:
                return 1.0
            sums = self.sums[kind, min(known, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))]
        return sums[0] / sums[1]


def stats(seq, steps: int) -> PerRequest:
    """The request's adaptive record, made on first use."""
    if seq.spec_stats is None:
        seq.spec_stats = PerRequest(steps)
    return seq.spec_stats
