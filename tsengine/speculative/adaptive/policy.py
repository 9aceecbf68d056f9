"""Adaptive speculation: every step, the way of running the next step that maximises its predicted tokens per
second, from acceptance measured while serving (`estimates.py`) and step costs (`costs.py`); the plan is run
by `proposer.py`.
Why each rule below is shaped as it is (the measurements that forced it) and the tests that guard it:
docs/design/adaptive.md. In short:

- Choices (`Arm`): plain; an EAGLE-3 chain of k = 1..S, each request drafting from the head, from prompt
  lookup or not at all, whichever its own record says commits more (not at all: plainly, or padded to keep
  the step uniform, `PAD`); the configured tree (and a small one).
- Prediction: tokens (counted by the time they save where a batch ends together, `_worth_ratio`) over
  seconds (`StepCosts`: the target's step from its shape's own record per batch bucket, else a fitted
  line, eager where the arm's last `HOT_AFTER` steps at this batch ran eagerly; the head's extension and
  drafting; the rest of the step), corrected by what each kind delivered at this batch bucket (`Correction`,
  one for every chain length of a source: `Plan.family`). Several requests that started
  together with none queued and freed slots not seen refilled (`Refills`): speculation must be predicted
  `MARGIN` faster than plain, elsewhere `EDGE` to be entered and `STAY` (level) to be kept.
- The head costs only the steps that draft from it: it extends over a request's rows when it drafts for
  it, catching up over the rows kept since (`Sequence.head_backlog`), so plain steps carry no upkeep.
- Exploration: every arm once, then one step in `explore_every` (× B/4 at B > 4 requests) runs a runner-up
  not last seen running eagerly at that batch (unless a graph has compiled since), or plain decoding (always
  a candidate; measured first at each batch bucket). Plain decoding far ahead (`HOLD`) is held a few
  decisions without pricing the candidates.

Lossless by construction: whatever is chosen, the target verifies it, so the output is plain decoding's
(tests/speculative/test_adaptive.py forces random plans through `AdaptivePolicy.choose`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import replace

from tsengine.speculative.adaptive.costs import StepCosts, shape_key
from tsengine.speculative.adaptive.estimates import Acceptance, Correction, MeanTokens, PerRequest, Refills, stats
from tsengine.speculative.adaptive.plan import PAD, Arm, Plan, kept_rows
from tsengine.speculative.drafts import Proposal

SMALL_TREE = (3, 2, 6)
MIN_GAIN = 0.1  # expected extra tokens below which a request is not worth its draft rows
MARGIN = 1.05  # speculation must be predicted this much faster than plain decoding to be chosen (`_ragged`)
# ... and this much elsewhere: a step's prediction misses what switching costs around it (eager catch-ups,
# the steps of an exploration), and at 4 requests a server mixing chains predicted 1-3% ahead with plain
# steps ran at 0.97x plain where both the pinned chain of 1 and forced plain ran at 0.99-1.02x (issue 43)
EDGE = 1.03
# ... to be entered; once chosen, a kind (`Plan.family`) stays while predicted at least `STAY` x plain. With
# one threshold, a chain whose prediction wandered around it ran on some steps and not on others: at 4
# requests the ninth server run drafted on 5-17% of the steps in four rounds and on 91% in the fifth, and
# ran 0.97x plain where the pinned chain of 1 ran 1.03x (issue 43). Entered at `EDGE` and left below `STAY`
# (hysteresis), a prediction's noise no longer flips the choice step to step.
STAY = 1.0
TOGETHER = 8  # steps apart requests may have started and still end together (chunked prefill staggers starts)
# Plain decoding predicted this much faster than every other plan: the next HOLD_STEPS - 1 decisions at the same
# batch size are plain without pricing the candidates (`_decide`). Pricing them every step cost a visible share
# of a plain step at 4 and 16 requests (issue 43), and estimates move little over steps that verify nothing.
HOLD, HOLD_STEPS = 1 / 1.1, 4


class AdaptivePolicy:
    def __init__(self, steps: int, tree: tuple[int, int, int] | None = None, ngram: bool = True,
                 explore_every: int = 32, seed: int = 0):
        self.draft_len = steps  # the draft length (chain) or depth (tree) chosen for the last step; 0: plain
        self.steps, self.ngram, self.explore_every = steps, ngram, explore_every
        self._together = False  # this decision's requests will end together, and no request waits for a slot
        self._ragged = False  # several requests that started together, none queued: `MARGIN` applies
        trees = [tree] if tree else []
        if tree and tree[1] > SMALL_TREE[1] and tree[0] >= SMALL_TREE[0]:
            trees.append(SMALL_TREE)
        self.arms = [Arm(k) for k in range(steps + 1)] + [Arm(*t) for t in trees]
        self.eagle = Acceptance(steps)
        self.lookup = Acceptance(steps, prior_rate=0.3)  # prompt lookup, over requests that had a match
        self.pad = Acceptance(steps, prior_rate=0.01)  # `PAD` drafts (a repeated token is sometimes right)
        self.tree_tokens = {a: MeanTokens(1.0 + 0.5 * a.steps) for a in self.arms if a.is_tree}
        self.costs = StepCosts()
        self._kept: list[int] = []  # this decision's rows kept per request (`choose`)
        self.decisions, self.last = 0, Plan(Arm(), [])
        self._held = (0, 0, 0.0)  # (plain decisions left unpriced, at this batch size, plain's tokens/s): `HOLD`
        self._incumbent = "plain"  # the kind (`Plan.family`) the last priced decision chose: `STAY`
        self._untried = PerRequest(steps)  # stands for a request with no record yet (read only)
        self.correction = Correction()
        self.refills = Refills()  # is a freed slot taken at once (`choose`)?
        self.clock = time.monotonic  # a test may replace it
        self.last_draft_seconds = 0.0
        self.chosen: Counter[str] = Counter()  # steps per arm name
        self.drafted_by: Counter[str] = Counter()  # requests per source
        self._rng = random.Random(seed)

    # ---- learning ---------------------------------------------------------------------------------------
    def learn(self, proposal: Proposal, quiet: bool = True) -> None:
        """Fold in what the step that just ran showed: its target time and every window's acceptance. Not
        `quiet` (a compile shared the cores during the step), its time teaches nothing: one request's
        in-process run, compiling beside its steps, fitted the target's line to 63 ms + -9 ms a row and
        priced chains of 1 and 2 at half their speed."""
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
            if d.source == PAD:
                self.pad.observe(drafted, accepted)
                continue
            (self.lookup if d.source == "ngram" else self.eagle).observe(drafted, accepted)
            stats(c.seq, self.steps).observe(d.source, drafted, accepted)
        if proposal.target_seconds > 0 and proposal.prefill_rows == 0:  # decode steps only: the choice never
            # changes a step's prefill work, and long prefill rows would pull the decode line off its range
            last = self.last
            self.costs.learn_step(proposal, last, tree_rows, quiet)
            # a step priced as a graph whose shape was not hot yet ran eagerly (tsengine/model/graphs.py `Heat`):
            # its cost is the line's eager term, not what its arm delivers once chosen, so the arm's correction
            # skips it. Priced eagerly (`cold`), it is what was promised: at 16 requests a chain of 1 whose
            # shape never compiles was promised 15-20% over plain decoding, ran eagerly below it, and taught
            # its correction nothing, so it was chosen again at the start of every batch (issue 43)
            cold = self.costs.graphs_seen and not proposal.graph and not last.mixed and not last.eager
            # a warm-up step was priced by lines fitted from nothing: a chain of 1 at 16 requests, promised many
            # times what any step delivers, kept a ratio far below 1 for good (a kind learns only when chosen)
            warm_up = self.decisions <= len(self.arms)
            if (last.raw_tokens_per_s > 0 and proposal.tokens and self.last_draft_seconds is not None
                    and quiet and not cold and not warm_up):
                seconds = proposal.target_seconds + self.last_draft_seconds
                # clamped: lines fitted from a handful of steps can promise a million tokens per second, and
                # one such step would hold a kind's ratio near 0 for a thousand steps
                promised = min(max(last.raw_tokens_per_s * seconds, proposal.tokens / 4), proposal.tokens * 4)
                self.correction.observe(last.family, len(last.sources), proposal.tokens, promised)

    def learn_draft(self, extended: int, plan: Plan, head_seconds: float | None,
                    overhead_seconds: float | None = 0.0, graph: bool | None = None) -> None:
        """`head_seconds`: the head's extension and drafting, without its catch-up over rows kept from earlier
        steps (timed apart: adaptive_proposer); None: it compiled a graph, which says nothing about the cost.
        Learned from steps that drafted from it (no other does head work);
        `overhead_seconds`: the rest of the step outside the forward (prompt lookup, the choice, commit,
        outputs; None: not measured, the line's estimate); `graph`: whether the head drafted through a compiled
        graph (None: it has none, eager is its norm: `StepCosts.learn_draft`)."""
        overhead_seconds = self.costs.learn_draft(extended, plan, head_seconds, overhead_seconds, graph)
        self.last = plan
        self.last_draft_seconds = None if head_seconds is None else head_seconds + overhead_seconds

    # ---- deciding ---------------------------------------------------------------------------------------
    def predict(self, arm: Arm, tokens: float, chain_rows: int, tree_rows: int, heads: int, batch: int,
                mixed: bool = False, kept: int = 0) -> float:
        """Tokens per second of a step of `batch` requests committing `tokens` (its seconds: `StepCosts.seconds`)."""
        return tokens / max(self.costs.seconds(arm, tokens, chain_rows, tree_rows, heads, batch, mixed, kept), 1e-9)

    def price(self, arm: Arm, sources: list[str], stats: list[PerRequest | None],
              found: list[list[int] | None] | None = None, worth: bool = False, catch_up: bool = False) -> float:
        """Predicted tokens per second of running `arm` with these sources (the lines alone, no optimism);
        `worth`: the tokens counted by the time they save (`_worth_ratio`); `catch_up`: with the head's
        catch-up over kept rows (the plan's cost; its correction compares the step without it)."""
        gains, chain_rows, tree_rows = [], 0, 0
        for j, (source, st) in enumerate(zip(sources, stats)):
            st = st or self._untried
            if source == "plain":
                gains.append(0.0)
                chain_rows += 1
            elif arm.is_tree:
                gains.append(self.tree_tokens[arm].mean - 1.0)
                tree_rows += arm.nodes
            else:
                k = min(arm.steps, len(found[j])) if source == "ngram" and found and found[j] else arm.steps
                gains.append(self.pad.tokens(k) - 1.0 if source == PAD
                             else st.tokens(source, k, self.eagle if source == "eagle3" else self.lookup) - 1.0)
                chain_rows += arm.steps + 1
        plain = sources.count("plain")
        tps = self.predict(arm, len(gains) + sum(gains), chain_rows, tree_rows, sources.count("eagle3"), len(sources),
                           mixed=0 < plain < len(sources), kept=kept_rows(sources, self._kept) if catch_up else 0)
        return tps * self._worth_ratio(gains) if worth else tps

    def _worth_ratio(self, gains: list[float]) -> float:
        """The step's tokens counted by the time they save, over the tokens it commits (1: all count; see
        docs/design/adaptive.md). For one request, or gains alike across the batch, the two counts agree."""
        batch, extra = len(gains), sum(gains)
        if not self._together or extra <= 0:
            return 1.0
        step = self.costs.target_seconds(Arm(0), batch, batch, 0)
        if step <= 0:
            return 1.0
        row = min(max(self.costs.target.theta[2], 0.0), step / batch)
        worth = (row * extra + (step - row * batch) * min(gains)) * batch / step
        return (batch + worth) / (batch + extra)

    def _chain_plan(self, k: int, stats: list[PerRequest | None], found: list[list[int] | None],
                    lookup_only: bool = False) -> Plan | None:
        """Chain length k for every request that has a source worth drafting from (its best by expected
        tokens: the head, or prompt lookup where its tokens offer a continuation); None if none has.
        `lookup_only`: prompt lookup or nothing. Per request the head may commit more, but one request on
        the head makes the step pay k sequential head forwards, which a lookup-only step does not."""
        sources, gains, heads = [], [], 0
        for st, f in zip(stats, found):
            st = st or self._untried
            options = []
            if not lookup_only and not st.head_gap:
                options.append((st.tokens("eagle3", k, self.eagle), "eagle3"))
            if f is not None:  # drafts past the continuation repeat its last token: count none of them
                options.append((st.tokens("ngram", min(k, len(f)), self.lookup, bonus=0.1), "ngram"))
            gain, source = max(options) if options else (1.0, "plain")
            if gain - 1.0 < MIN_GAIN:
                source = "plain"
            sources.append(source)
            gains.append(0.0 if source == "plain" else gain - 1.0)
            heads += source == "eagle3"
        if sources.count("plain") == len(sources):
            return None
        kept = kept_rows(sources, self._kept)
        plan = self._chain_priced(k, sources, gains, heads, kept)
        if self.ngram and "plain" in sources:  # mixed, it runs eagerly; padded, the step is uniform (a graph)
            pad = self.pad.tokens(k) - 1.0
            padded = self._chain_priced(k, [PAD if s == "plain" else s for s in sources],
                                        [pad if s == "plain" else g for s, g in zip(sources, gains)], heads, kept)
            # where steps run as graphs, never mixed: its step runs eagerly, dearer than the line's eager term
            # says (a row count met for the first time builds its matmul kernels on the spot; in-process traces
            # at 4 requests had eager chain steps at several times a compiled one: docs/benchmarks.md,
            # "Adaptive speculation by default")
            plan = padded if self.costs.graphs_seen else max(plan, padded, key=lambda p: p.tokens_per_s)
        return plan

    def _chain_priced(self, k: int, sources: list[str], gains: list[float], heads: int, kept: int) -> Plan:
        batch, drafting = len(sources), len(sources) - sources.count("plain")
        plan = Plan(Arm(k), sources)
        tps = self.predict(Arm(k), batch + sum(gains), batch + drafting * k, 0, heads, batch, mixed=drafting < batch,
                           kept=kept)
        plan.tokens_per_s = tps * self._worth_ratio(gains) * self.correction(plan.family, batch)
        return plan

    def candidates(self, stats: list[PerRequest | None], found: list[list[int] | None]) -> list[Plan]:
        """Plain decoding first, then the best plan of each chain length and each tree (tokens per second
        predicted with optimism for barely tried sources, and corrected by each arm's record)."""
        batch = len(stats)
        plain = self.predict(Arm(0), batch, batch, 0, 0, batch) * self.correction("plain", batch)
        plans = [Plan(Arm(0), ["plain"] * batch, plain)]
        chains = [a.steps for a in self.arms if a.steps and not a.is_tree]
        plans += filter(None, (self._chain_plan(k, stats, found) for k in chains))
        if any(f is not None for f in found):
            plans += filter(None, (self._chain_plan(k, stats, found, lookup_only=True) for k in chains))
        heads = ["plain" if st and st.head_gap else "eagle3" for st in stats]
        if "eagle3" in heads:
            plans += [Plan(a, heads, self.price(a, heads, stats, worth=True, catch_up=True)
                           * self.correction(a.name, batch)) for a in self.tree_tokens]
        return plans

    def _best(self, plans: list[Plan]) -> Plan:
        """What the policy runs of these (exploration aside): the fastest of those predicted `EDGE` faster than
        plain, or `STAY` for the kind chosen last (`_incumbent`), or `MARGIN` where a ragged finish can cost
        (several requests that started together, none queued: `choose`); else plain decoding."""
        plain = plans[0].tokens_per_s

        def needs(p: Plan) -> float:
            return MARGIN if self._ragged else STAY if p.family == self._incumbent else EDGE

        return max((p for p in plans[1:] if p.tokens_per_s >= needs(p) * plain), key=lambda p: p.tokens_per_s,
                   default=plans[0])

    def choose(self, stats: list[PerRequest | None], found: list[list[int] | None],
               remaining: list[int | None] | None = None, queued: int = 0, kept: list[int] | None = None) -> Plan:
        """The plan for the next step of these drafting requests (their stats, their n-gram continuation
        or None, the tokens each will still generate or None where EOS may end it, the rows the head kept for
        each: its catch-up before it drafts for it), with `queued` requests waiting for a slot. A test hook
        may replace it: any plan is lossless.

        The requests end together (`_together`) when every end is known and they started decoding within
        `TOGETHER` steps of each other (their ages, in decisions, not their remaining tokens: speculation
        spreads those, and a batch that started together and drifted apart still ends with its longest).
        Where any may stop at EOS, each is as likely to be the last, and the expected time a token saves is
        again one token's; where they started apart (a client sending its next request as one ends), the
        next arrival is likely to take a freed slot as a queued request would."""
        self._kept = kept or [0] * len(stats)
        for st in stats:
            if st is not None:
                st.age += 1
        ages = [st.age if st else 0 for st in stats]
        self.refills.observe([st for st in stats if st is not None], self.clock())
        known = bool(remaining) and len(remaining) > 1 and None not in remaining
        # `MARGIN` where the batch thins out with nothing to refill it. Started apart, a client's next request
        # is likely to take a freed slot: at 4 requests so sent, the margin held a chain of 1 that ran faster
        # per step than plain decoding, but was predicted inside the margin, to plain on about a quarter of the
        # steps (traced: docs/benchmarks-journal.md, "The margin only for batches that started together: 4 requests").
        # Equally long requests decoded plainly end at one step and their successors start at one: ages alone
        # took every such wave for a batch that thins out, where each freed slot was refilled (`Refills`).
        self._ragged = (len(stats) > 1 and not queued and not self.refills.likely
                        and max(ages) - min(ages) <= TOGETHER)
        self._together = known and self._ragged
        plan = self._decide(stats, found)
        plan.sources = [s if s != "eagle3" or not (st and st.head_gap) else "plain"
                        for s, st in zip(plan.sources, stats)]  # the warm-up's and exploration's too
        plan.raw_tokens_per_s = self.price(plan.arm, plan.sources, stats, found)
        plan.eager = self.costs.graphs_seen and self.costs.cold(plan.arm, len(stats))
        return plan

    def _decide(self, stats: list[PerRequest | None], found: list[list[int] | None]) -> Plan:
        self.decisions += 1
        batch = len(stats)
        if self.decisions <= len(self.arms):  # warm-up: every arm once, so every cost term is seen
            arm = self.arms[self.decisions - 1]
            return Plan(arm, ["eagle3" if arm.steps else "plain"] * batch, explored=True)
        found = found if self.ngram else [None] * batch
        costs = self.costs
        if costs.graphs_seen and shape_key(Arm(0), batch) not in costs.step_seconds and not costs.cold(Arm(0), batch):
            # plain decoding not measured at this batch bucket yet: measured first (its eager steps heat its
            # shape, whose graph then compiles off the engine thread; exploration finds it compiled). Priced
            # from the line through chain steps instead, it was never chosen or explored at 4 requests
            return Plan(Arm(0), ["plain"] * batch, explored=True)
        # a step off the best costs a batch of B requests ~B rows of waste, and an arm rarely run may compile
        # a graph: at 16 requests, exploring every 32 decisions cost a visible share of the plain steps it
        # interrupted (docs/benchmarks-journal.md, "Where the adaptive server loses at 16 requests")
        explore = not self.decisions % (self.explore_every * max(1, batch // 4))
        held, held_batch, plain = self._held
        if held and held_batch == batch and not explore:
            self._held = held - 1, batch, plain
            return Plan(Arm(0), ["plain"] * batch, plain)
        plans = self.candidates(stats, found)
        best, plain = self._best(plans), plans[0].tokens_per_s
        self._incumbent = best.family
        runner_up = max((p.tokens_per_s for p in plans[1:]), default=0.0)
        self._held = (HOLD_STEPS - 1 if best is plans[0] and runner_up < HOLD * plain else 0), batch, plain
        if not explore:
            return best
        near = [p for p in plans if p is not best and (p is plans[0] or p.tokens_per_s >= 0.7 * best.tokens_per_s)
                and self.costs.explorable(p.arm, batch)]  # plain decoding, the baseline, however far behind
        if near:
            return replace(self._rng.choice(near), explored=True)
        k = best.arm.steps if not best.arm.is_tree else self.steps
        ks = [x for x in (k - 1, k + 1) if 0 <= x <= self.steps and self.costs.explorable(Arm(x), batch)]
        if not ks:
            return best
        k = self._rng.choice(ks)
        return Plan(Arm(k), ["eagle3" if k and not (st and st.head_gap) else "plain" for st in stats], explored=True)

    def describe(self) -> str:
        """The periodic log line's part: estimates and what was chosen."""
        rates = " ".join(f"{r:.2f}" for r in self.eagle.rates())
        look = " ".join(f"{r:.2f}" for r in self.lookup.rates())
        top = ", ".join(f"{name} {n}" for name, n in self.chosen.most_common(3))
        return f"policy: chose {top}; eagle3 acceptance {rates}; ngram {look}"
