"""Adaptive speculation: every step, the way of running the next step that maximises its predicted tokens per
second, from acceptance and costs measured while serving (`tsengine/spec/estimates.py`).

The choices (`Arm`): plain decoding; an EAGLE-3 chain of k = 1..S drafts; the configured EAGLE-2 tree (and
a small 3x2x6 tree beside a larger one). Within a chain of length k each request is decided apart: it
drafts from the head, from prompt lookup (NGRAM, where its own tokens offer a continuation), or not at
all, whichever its own running acceptance (shrunk towards the average) says commits more. That is the
hybrid drafter in its cheap form: one batch, one target forward, two sources; a tree whose branches mix
both sources is not built (see docs/speculation-guide.md).

The prediction for B decoding requests, m of which draft (k tokens each, E of them from the head), with
expected gains g_j (tokens beyond the one plain decoding gives):
    tokens   = B + Σ g_j
    seconds  = target(B + m·k rows) + drafter(extension, k forwards over E·k rows)
Speculation is all or nothing across the batch: every request that has a source drafts, except one whose
best source is expected to gain under `MIN_GAIN` tokens. Choosing the subset that maximises the step's
tokens per second (tried first) lost 10% at 16 requests: requests that start and stop together finish
when the slowest does, so speeding up some of them shortens nothing while every step pays their rows.

The costs are lines fitted by recursive least squares (`LinearCost`): the target's decode step as base +
per chain row + per tree row (bitmask attention costs more), the drafter's as base + per
extended row + per sequential head forward + per drafted row. One model for every arm, so a length the
policy has rarely chosen is still priced from what every other step taught it.

The head's own upkeep: it extends its one layer over every committed row, so that drafting can resume at
any step; that is ~4% of a target step, paid by plain steps too. When a full-batch chain of 1 has been
predicted below plain for `switch_after` (8) decisions in a row, the head is switched off: no extension,
prompt lookup and plain decoding only. (A slower switch, below 0.95× for 16 decisions, kept the head on
at 16 requests, where the chain of 1 then ran 86% of the steps and lost 8% to plain; this one turned it
off at 4 requests, where that chain is best by 4%: docs/benchmarks.md.) Requests that miss positions
then cannot draft from the head until a recompute rebuilds their draft cache (`PerRequest.head_gap`);
requests admitted after the head is back on can. It comes back on after `switch_after` decisions
predicted at `MARGIN` + 0.05 or more, or for a trial every `reprobe` (256) decisions off (its estimates do
not move while off).

Speculation must be predicted `MARGIN` (1.05×) faster than plain decoding to be chosen. Below that the
gain is within the models' error, and a batch that speculates finishes raggedly: requests accept at
different rates, so the batch thins out before its slowest request is done, and those thin steps cost
nearly as much as full ones. Measured at 16 requests that start together: the chain of 1 was predicted
(and per step delivered) ~5% above plain and finished 10% below it.

The lines are right on average, not at every load: a step's cost is not linear in its rows on a CPU, and
the head's acceptance depends on the prompts of the moment. So every plan's prediction is corrected by
what that arm actually delivered at that batch size: realized / predicted tokens as a ratio of decayed
sums (`Correction`, per arm and main source and power-of-two batch bucket, over the steps without prefill
rows). Near a
break-even, where a small bias in either model picks the wrong side, the realized rate decides.

Exploration: the first steps try each arm once, then one step in `explore_every` (32) runs a random
runner-up predicted within 30% of the best (or a neighbouring chain length), so estimates stay alive
without paying for hopeless arms. The decision is random; the output never is.

Lossless by construction: whatever is chosen, the target verifies it, so the output is plain decoding's:
greedy token for token, seeded sampling identical (tests/test_adaptive.py forces random plans through
`AdaptivePolicy.choose`, trees and NGRAM included, with chunked prefill and preemption).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

from tsengine import graphs
from tsengine.spec.drafts import Proposal
from tsengine.spec.estimates import Acceptance, LinearCost, MeanTokens, PerRequest

SMALL_TREE = (3, 2, 6)
MIN_GAIN = 0.1  # expected extra tokens below which a request is not worth its draft rows
MARGIN = 1.05  # speculation must be predicted this much faster than plain decoding to be chosen


@dataclass(frozen=True)
class Arm:
    """One way to run a step: a chain of `steps` drafts (0: plain), or a tree (topk > 1) of `nodes`."""

    steps: int = 0
    topk: int = 1
    nodes: int = 0

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.steps, self.topk, self.nodes

    @property
    def name(self) -> str:
        return (f"tree {self.steps}x{self.topk}x{self.nodes}" if self.is_tree
                else f"chain {self.steps}" if self.steps else "plain")


@dataclass
class Plan:
    """The decision for one step: the arm, and per drafting request its source (eagle3, ngram or plain)."""

    arm: Arm
    sources: list[str]
    tokens_per_s: float = 0.0  # predicted, corrected by what the arm delivered (`Correction`)
    raw_tokens_per_s: float = 0.0  # predicted by the lines alone

    @property
    def eagle(self) -> list[bool]:
        return [s == "eagle3" for s in self.sources]

    @property
    def kind(self) -> str:
        """The arm, and for a chain its main source: prompt lookup and the head deliver differently."""
        lookup = self.sources.count("ngram") > self.sources.count("eagle3")
        return self.arm.name + (" ngram" if lookup and not self.arm.is_tree else "")


class Correction:
    """Per (plan kind, batch bucket): realized / predicted tokens, as a ratio of decayed sums, from 1.

    A ratio of sums, not a mean of per-step ratios: one step of a chain commits 1 to k + 1 tokens, so its
    own ratio swings by ±50%. A running mean of those (weight 0.15, the first revision) wandered ±13%,
    more than `MARGIN`, and a kind that drifted low stopped being chosen and stayed low (it learns only
    when chosen): at batch 1 every speculative kind sat at 0.72–0.87 while its steps delivered 1.2× plain
    (measured, docs/benchmarks.md). `prior` pseudo-steps at ratio 1 keep a barely tried kind near 1."""

    def __init__(self, weight: float = 0.02, prior: float = 4.0):
        self.weight, self.prior, self.sums = weight, prior, {}

    @property
    def ratio(self) -> dict:
        return {k: got / want for k, (got, want) in self.sums.items()}

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
        known = [b for (n, b) in self.ratio if n == kind]
        if not known:
            return 1.0
        nearest = min(known, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self.ratio[kind, nearest]


class AdaptivePolicy:
    def __init__(self, steps: int, tree: tuple[int, int, int] | None = None, ngram: bool = True,
                 explore_every: int = 32, switch_after: int = 8, seed: int = 0):
        self.steps, self.ngram, self.explore_every, self.switch_after = steps, ngram, explore_every, switch_after
        self.head_on, self._streak, self._off_for, self.reprobe = True, 0, 0, 256
        trees = [tree] if tree else []
        if tree and tree[1] > SMALL_TREE[1] and tree[0] >= SMALL_TREE[0]:
            trees.append(SMALL_TREE)
        self.arms = [Arm(k) for k in range(steps + 1)] + [Arm(*t) for t in trees]
        self.eagle = Acceptance(steps)
        self.lookup = Acceptance(steps, prior_rate=0.3)  # prompt lookup, over requests that had a match
        self.tree_tokens = {a: MeanTokens(1.0 + 0.5 * a.steps) for a in self.arms if a.is_tree}
        self.target_cost = LinearCost(("base", "per_chain_row", "per_tree_row"))
        self.draft_cost = LinearCost(("base", "per_extended_row", "per_forward", "per_draft_row"))
        self.decisions, self.last = 0, Plan(Arm(), [])
        self._untried = PerRequest(steps)  # stands for a request with no record yet (read only)
        self.correction = Correction()
        self.last_draft_seconds = 0.0
        self.chosen: Counter[str] = Counter()  # steps per arm name
        self.drafted_by: Counter[str] = Counter()  # requests per source
        self._rng = random.Random(seed)

    # ---- learning ---------------------------------------------------------------------------------------
    def learn(self, proposal: Proposal) -> None:
        """Fold in what the step that just ran showed: its target time and every window's acceptance."""
        tree_rows = 0
        for c in proposal.runs:
            if c.verified is None or c.seq.drafts is None:
                continue
            drafted, accepted = c.verified
            d = c.seq.drafts
            if d.tree is not None:
                tree_rows += drafted + 1
                if self.last.arm.is_tree:
                    self.tree_tokens[self.last.arm].observe(accepted)
                continue
            (self.lookup if d.source == "ngram" else self.eagle).observe(drafted, accepted)
            stats(c.seq, self.steps).observe(d.source, drafted, accepted)
        if proposal.target_seconds > 0 and proposal.prefill_rows == 0:  # decode steps only: the choice never
            # changes a step's prefill work, and long prefill rows would pull the decode line off its range
            self.target_cost.update([1.0, proposal.decode_rows - tree_rows, tree_rows], proposal.target_seconds)
            last = self.last
            if last.raw_tokens_per_s > 0 and proposal.tokens and self.last_draft_seconds is not None:
                realized = proposal.tokens / (proposal.target_seconds + self.last_draft_seconds)
                seconds = proposal.target_seconds + self.last_draft_seconds
                self.correction.observe(last.kind, len(last.sources), proposal.tokens, last.raw_tokens_per_s * seconds)

    def learn_draft(self, extended: int, plan: Plan, seconds: float | None) -> None:
        """`seconds` None: the drafter compiled a graph in this step, which says nothing about its cost."""
        if seconds is not None:
            self.draft_cost.update([1.0, extended, *self._draft_work(plan.arm, sum(plan.eagle))], seconds)
        self.last, self.last_draft_seconds = plan, seconds

    # ---- deciding ---------------------------------------------------------------------------------------
    def _draft_work(self, arm: Arm, heads: int) -> tuple[int, int]:
        """(sequential head forwards, rows drafted) for `heads` requests drafting from the head."""
        if heads == 0 or arm.steps == 0:
            return 0, 0
        if arm.is_tree:
            return arm.steps, heads * (1 + arm.topk * (arm.steps - 1))
        return arm.steps, heads * arm.steps

    def predict(self, arm: Arm, tokens: float, chain_rows: int, tree_rows: int, heads: int) -> float:
        seconds = (self.target_cost.predict([1.0, chain_rows, tree_rows])
                   + self.draft_cost.predict([1.0, tokens, *self._draft_work(arm, heads)]))
        return tokens / max(seconds, 1e-9)

    def price(self, arm: Arm, sources: list[str], stats: list[PerRequest | None],
              found: list[list[int] | None] | None = None) -> float:
        """Predicted tokens per second of running `arm` with these sources (the lines alone, no optimism)."""
        tokens, chain_rows, tree_rows = 0.0, 0, 0
        for j, (source, st) in enumerate(zip(sources, stats)):
            st = st or self._untried
            if source == "plain":
                tokens, chain_rows = tokens + 1, chain_rows + 1
            elif arm.is_tree:
                tokens, tree_rows = tokens + self.tree_tokens[arm].mean, tree_rows + arm.nodes
            else:
                k = min(arm.steps, len(found[j])) if source == "ngram" and found and found[j] else arm.steps
                tokens += st.tokens(source, k, self.eagle if source == "eagle3" else self.lookup)
                chain_rows += arm.steps + 1
        return self.predict(arm, tokens, chain_rows, tree_rows, sources.count("eagle3"))

    def _chain_plan(self, k: int, stats: list[PerRequest | None], found: list[list[int] | None],
                    lookup_only: bool = False) -> Plan | None:
        """Chain length k for every request that has a source worth drafting from (its best by expected
        tokens: the head, or prompt lookup where its tokens offer a continuation); None if none has.
        `lookup_only`: prompt lookup or nothing. Per request the head may commit more, but one request on
        the head makes the step pay k sequential head forwards, which a lookup-only step does not."""
        sources, tokens, heads = [], float(len(stats)), 0
        for st, f in zip(stats, found):
            st = st or self._untried
            options = []
            if self.head_on and not st.head_gap and not lookup_only:
                options.append((st.tokens("eagle3", k, self.eagle), "eagle3"))
            if f is not None:  # drafts past the continuation repeat its last token: count none of them
                options.append((st.tokens("ngram", min(k, len(f)), self.lookup, bonus=0.1), "ngram"))
            gain, source = max(options) if options else (1.0, "plain")
            if gain - 1.0 < MIN_GAIN:
                source = "plain"
            sources.append(source)
            if source != "plain":
                tokens, heads = tokens + gain - 1.0, heads + (source == "eagle3")
        drafting = len(sources) - sources.count("plain")
        if not drafting:
            return None
        plan = Plan(Arm(k), sources)
        plan.tokens_per_s = self.predict(Arm(k), tokens, len(stats) + drafting * k, 0, heads) * self.correction(
            plan.kind, len(stats))
        return plan

    def candidates(self, stats: list[PerRequest | None], found: list[list[int] | None]) -> list[Plan]:
        """Plain decoding first, then the best plan of each chain length and each tree (tokens per second
        predicted with optimism for barely tried sources, and corrected by each arm's record)."""
        batch = len(stats)
        plans = [Plan(Arm(0), ["plain"] * batch, self.predict(Arm(0), batch, batch, 0, 0) * self.correction("plain", batch))]
        chains = [a.steps for a in self.arms if a.steps and not a.is_tree]
        plans += filter(None, (self._chain_plan(k, stats, found) for k in chains))
        if self.head_on and any(f is not None for f in found):
            plans += filter(None, (self._chain_plan(k, stats, found, lookup_only=True) for k in chains))
        heads = ["eagle3" if self.head_on and not (st and st.head_gap) else "plain" for st in stats]
        if "eagle3" in heads:
            plans += [Plan(a, heads, self.price(a, heads, stats) * self.correction(a.name, batch)) for a in self.tree_tokens]
        return plans

    def _switch_head(self, batch: int, plain_tps: float) -> None:
        """Hysteresis on whether the head's upkeep can pay at this load (see the module docstring)."""
        chain = self.predict(Arm(1), batch * self.eagle.tokens(1), 2 * batch, 0, batch) * self.correction("chain 1", batch)
        ratio = chain / plain_tps
        pays = ratio >= MARGIN + 0.05 if not self.head_on else ratio >= 1.0
        self._streak = 0 if pays == self.head_on else self._streak + 1
        self._off_for = 0 if self.head_on else self._off_for + 1
        # off, the head's estimates stop moving, so it could stay off for good: every `reprobe` decisions
        # it is tried again (new requests get its upkeep; it goes off again if it still does not pay)
        if self._streak >= self.switch_after or self._off_for >= self.reprobe:
            self.head_on, self._streak, self._off_for = not self.head_on, 0, 0

    def choose(self, stats: list[PerRequest | None], found: list[list[int] | None]) -> Plan:
        """The plan for the next step of these drafting requests (their stats, their n-gram continuation
        or None). A test hook may replace it: any plan is lossless."""
        plan = self._decide(stats, found)
        plan.raw_tokens_per_s = self.price(plan.arm, plan.sources, stats, found)
        return plan

    def _decide(self, stats: list[PerRequest | None], found: list[list[int] | None]) -> Plan:
        self.decisions += 1
        batch = len(stats)
        if self.decisions <= len(self.arms):  # warm-up: every arm once, so every cost term is seen
            arm = self.arms[self.decisions - 1]
            return Plan(arm, ["eagle3" if arm.steps else "plain"] * batch)
        plans = self.candidates(stats, found if self.ngram else [None] * batch)
        self._switch_head(batch, plans[0].tokens_per_s)
        best = max(plans, key=lambda p: p.tokens_per_s)
        if best.tokens_per_s < MARGIN * plans[0].tokens_per_s:
            best = plans[0]
        if self.decisions % self.explore_every:
            return best
        near = [p for p in plans if p is not best and p.tokens_per_s >= 0.7 * best.tokens_per_s]
        if near:
            return self._rng.choice(near)
        if not self.head_on:
            return best
        k = best.arm.steps if not best.arm.is_tree else self.steps
        k = self._rng.choice([x for x in (k - 1, k + 1) if 0 <= x <= self.steps])
        return Plan(Arm(k), ["eagle3" if k and not (st and st.head_gap) else "plain" for st in stats])

    def describe(self) -> str:
        """The periodic log line's part: estimates and what was chosen."""
        rates = " ".join(f"{r:.2f}" for r in self.eagle.rates())
        look = " ".join(f"{r:.2f}" for r in self.lookup.rates())
        top = ", ".join(f"{name} {n}" for name, n in self.chosen.most_common(3))
        return (f"policy: chose {top}; head {'on' if self.head_on else 'off'}; eagle3 acceptance {rates}; "
                f"ngram {look}")


class AdaptiveProposer:
    """Runs the plan `AdaptivePolicy.choose` makes: the EAGLE-3 proposer drafts for the requests assigned to
    it (a chain or a tree), prompt lookup for the others; the head extends over every committed row."""

    def __init__(self, eagle, ngram, steps: int, tree: tuple[int, int, int] | None = None, use_ngram: bool = True,
                 seed: int = 0):
        self.inner, self.ngram = eagle, ngram
        self.policy = AdaptivePolicy(steps, tree, ngram=use_ngram, seed=seed)
        self.draft_len = steps

    def propose(self, proposal: Proposal):
        policy = self.policy
        policy.learn(proposal)
        head = policy.head_on
        for c in proposal.runs:  # off, the head misses these rows; a run starting where the head's KV ends
            if not head or c.start == c.seq.draft_cached:  # (position 0, or a cached prefix) rebuilds them
                stats(c.seq, self.policy.steps).head_gap = not head
        need = proposal.drafting
        t0, compiled_before = time.perf_counter(), graphs.compiles()
        found = [self.ngram.lookup(seq) for seq in need] if policy.ngram and need else [None] * len(need)
        plan = policy.choose([seq.spec_stats for seq in need], found) if need else Plan(Arm(0), [])
        arm, eagle, drafts = plan.arm, plan.eagle, []
        if head and arm.is_tree:
            drafts = self.inner.propose(proposal, tree=arm.shape, only=eagle)
        elif head:
            drafts = self.inner.propose(proposal, steps=arm.steps if any(eagle) else 0, only=eagle)
        drafts = drafts or [None] * len(need)
        for j, source in enumerate(plan.sources):
            if source == "ngram" and found[j] is not None:
                drafts[j] = self.ngram.drafts(found[j], arm.steps)
        if need:
            first = next((d for d in drafts if d is not None), None)
            if first is not None:
                first.tokens.sum().item()  # a host sync, on purpose: the drafter's time must be measured
            extended = sum(len(c.rows) for c in proposal.runs) if head else 0
            fresh = graphs.compiles() != compiled_before
            policy.learn_draft(extended, plan, None if fresh else time.perf_counter() - t0)
            self.draft_len = arm.steps
            policy.chosen[arm.name] += 1
            policy.drafted_by.update(plan.sources)
        return drafts


def stats(seq, steps: int) -> PerRequest:
    """The request's adaptive record, made on first use."""
    if seq.spec_stats is None:
        seq.spec_stats = PerRequest(steps)
    return seq.spec_stats
