"""Adaptive speculation: every step, the way of running the next step that maximises its predicted tokens per
second, from acceptance and costs measured while serving (`estimates.py`); the plan is run by `proposer.py`.
Why each rule below is shaped as it is (the measurements that forced it) and the tests that guard it:
docs/design/adaptive.md. In short:

- Choices (`Arm`): plain; an EAGLE-3 chain of k = 1..S, each request drafting from the head, from prompt
  lookup or not at all, whichever its own record says commits more (not at all: plainly, or padded to keep
  the step uniform, `PAD`); the configured tree (and a small one).
- Prediction: tokens (counted by the time they save where a batch ends together, `_worth_ratio`) over
  seconds (the target's step from a fitted line, eager where the arm's last `HOT_AFTER` steps at this batch
  ran eagerly, plain decoding's from its own record per batch bucket; the head's extension and drafting;
  the rest of the step),
  corrected by what each kind delivered at this batch bucket (`Correction`). Several requests that started
  together with none queued: speculation must be predicted `MARGIN` faster than plain, elsewhere `EDGE`.
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
from collections import Counter
from dataclasses import replace

from tsengine.model.graphs import BATCH_BUCKETS, HOT_AFTER, bucket
from tsengine.speculative.adaptive.estimates import (
    Acceptance,
    Correction,
    LinearCost,
    MeanTokens,
    PerRequest,
    RunningMean,
    stats,
)
from tsengine.speculative.adaptive.plan import PAD, Arm, Plan, kept_rows
from tsengine.speculative.drafts import Proposal

SMALL_TREE = (3, 2, 6)
MIN_GAIN = 0.1  # expected extra tokens below which a request is not worth its draft rows
MARGIN = 1.05  # speculation must be predicted this much faster than plain decoding to be chosen (`_ragged`)
# ... and this much elsewhere: a step's prediction misses what switching costs around it (eager catch-ups,
# the steps of an exploration), and at 4 requests a server mixing chains predicted 1-3% ahead with plain
# steps ran at 0.97x plain where both the pinned chain of 1 and forced plain ran at 0.99-1.02x (issue 43)
EDGE = 1.03
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
        # the target step: a line over steps of more than one row (a step mixing decodes with windows runs
        # eagerly: tsengine/model/graphs.py), for shapes without a record of their own; and each uniform plain
        # or chain step's own record per graph batch bucket (`step_seconds`), which prices that shape where
        # it exists. The line is not straight: one row runs MKL's sgemv, more rows oneDNN's packed kernel with
        # a higher floor (tsengine/model/linear.py), and at 4 requests a line fitted from chain steps put
        # plain's 29 ms step at 46 ms (chains of 3 then ran at 0.92x plain's speed through a server). With one
        # correction for every chain length (`Plan.family`), lengths are told apart by their own steps.
        self.target_cost = LinearCost(("base", "eager", "per_chain_row", "per_tree_row"))
        self.step_seconds: dict[tuple[Arm, int], RunningMean] = {}  # `shape_key` -> the target's step seconds
        self.graphs_seen = False  # a step ran through a compiled graph: uniform steps are not eager
        # (arm, graph batch bucket: `shape_key`) -> its uniform decode steps in a row that ran eagerly (0: its
        # last one ran through a compiled graph). A shape compiles only once hot (tsengine/model/graphs.py
        # `Heat`), so an arm chosen now and then (a chain at 16 requests) runs eagerly every time it is chosen:
        # priced as a graph step, such steps cost the adaptive server several plain steps each
        # (docs/benchmarks.md, "Adaptive speculation by default"). Priced eagerly from its first step on, an
        # arm that wins only as a graph never got the steps that heat it: at one request the policy settled
        # on the chain of 1 that heated first (`cold`).
        self.eager_runs: dict[tuple[Arm, int], int] = {}
        # graphs compiled so far in this process (the proposer sets it every step), and its value when each
        # (arm, batch) last ran eagerly: exploration retries such an arm only once a graph has compiled since
        self.compiled = 0
        self._eager_at: dict[tuple[Arm, int], int] = {}
        # the head's time (extension + drafting), learned from steps that draft from it (no other step does
        # head work); prompt lookup's and the decision's apart (every step pays them)
        self.draft_cost = LinearCost(("base", "per_extended_row", "per_forward", "per_draft_row"))
        self.overhead_cost = LinearCost(("base", "per_request"))
        # the head's catch-up over rows kept while it did not draft (a pass of its own: adaptive_proposer)
        self.catch_up_cost = LinearCost(("base", "per_row"))
        self._kept: list[int] = []  # this decision's rows kept per request (`choose`)
        self.decisions, self.last = 0, Plan(Arm(), [])
        self._held = (0, 0, 0.0)  # (plain decisions left unpriced, at this batch size, plain's tokens/s): `HOLD`
        self._untried = PerRequest(steps)  # stands for a request with no record yet (read only)
        self.correction = Correction()
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
            if proposal.graph and not self.graphs_seen:  # the eager plain steps before it were not the norm
                self.graphs_seen, self.step_seconds = True, {}
            last = self.last
            shape = self._uniform_shape(proposal.decode_rows)
            if quiet and shape is not None and (proposal.graph or not self.graphs_seen):
                self.step_seconds.setdefault(shape, RunningMean()).observe(proposal.target_seconds)
            if quiet and proposal.decode_rows > 1:
                self.target_cost.update([1.0, float(not proposal.graph), proposal.decode_rows - tree_rows, tree_rows],
                                        proposal.target_seconds)
            mixed = 0 < last.sources.count("plain") < len(last.sources)
            if last.sources and not mixed:
                key = shape_key(last.arm, len(last.sources))
                self.eager_runs[key] = 0 if proposal.graph else self.eager_runs.get(key, 0) + 1
                self._eager_at[key] = self.compiled
            # a step priced as a graph whose shape was not hot yet ran eagerly (tsengine/model/graphs.py `Heat`):
            # its cost is the line's eager term, not what its arm delivers once chosen, so the arm's correction
            # skips it. Priced eagerly (`cold`), it is what was promised: at 16 requests a chain of 1 whose
            # shape never compiles was promised 15-20% over plain decoding, ran eagerly below it, and taught
            # its correction nothing, so it was chosen again at the start of every batch (issue 43)
            cold = self.graphs_seen and not proposal.graph and not mixed and not last.eager
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
                    overhead_seconds: float | None = 0.0) -> None:
        """`head_seconds`: the head's extension and drafting, without its catch-up over rows kept from earlier
        steps (timed apart: adaptive_proposer); None: it compiled a graph, which says nothing about the cost.
        Learned from steps that drafted from it (no other does head work);
        `overhead_seconds`: the rest of the step outside the forward (prompt lookup, the choice, commit,
        outputs; None: not measured, the line's estimate)."""
        if head_seconds is not None and any(plan.eagle):
            self.draft_cost.update([1.0, extended, *self._draft_work(plan.arm, sum(plan.eagle))], head_seconds)
        if overhead_seconds is None:
            overhead_seconds = self.overhead_cost.predict([1.0, len(plan.sources)])
        else:
            self.overhead_cost.update([1.0, len(plan.sources)], overhead_seconds)
        self.last = plan
        self.last_draft_seconds = None if head_seconds is None else head_seconds + overhead_seconds

    # ---- deciding ---------------------------------------------------------------------------------------
    def _draft_work(self, arm: Arm, heads: int) -> tuple[int, int]:
        """(sequential head forwards, rows drafted) for `heads` requests drafting from the head."""
        if heads == 0 or arm.steps == 0:
            return 0, 0
        if arm.is_tree:
            return arm.steps, heads * (1 + arm.topk * (arm.steps - 1))
        return arm.steps, heads * arm.steps

    def _uniform_shape(self, decode_rows: int) -> tuple[Arm, int] | None:
        """The last step's `shape_key` where it was uniform, a plain or chain step in which every request ran
        the plan's rows (its record, `step_seconds`, prices that shape); else None."""
        last, n = self.last, len(self.last.sources)
        if decode_rows == 1:
            return shape_key(Arm(0), 1)
        k = last.arm.steps
        if n and not last.arm.is_tree and decode_rows == n * (k + 1) and (not k or "plain" not in last.sources):
            return shape_key(last.arm, n)
        return None

    def _target_seconds(self, arm: Arm, batch: int, chain_rows: int, tree_rows: int, mixed: bool = False,
                        cold: bool = False) -> float:
        """The target's step: the shape's own record (`step_seconds`) where it runs as one, else the line (a
        mixed step runs eagerly, and so does a step whose graph is `cold`)."""
        if not mixed and not cold:
            step = self.step_seconds.get(shape_key(arm, batch))
            if step is not None:
                return step.value
        eager = mixed or cold or not self.graphs_seen
        return self.target_cost.predict([1.0, float(eager), chain_rows, tree_rows])

    def cold(self, arm: Arm, batch: int) -> bool:
        """The arm's step at this batch would run eagerly: its last `HOT_AFTER` steps here did, with no graph
        step since. Fewer than that, it is priced as the graph it becomes when chosen: `HOT_AFTER` steps in a
        row heat its shape and the graph compiles off the engine thread (tsengine/model/graphs.py), and an
        exploration step finds it compiled later. Priced eagerly from its first step on, an arm that wins only
        as a graph never got those steps (at one request, the chain of 1 heated first and the longer chains,
        faster as graphs, were never chosen again)."""
        return self.eager_runs.get(shape_key(arm, batch), 0) >= HOT_AFTER

    def predict(self, arm: Arm, tokens: float, chain_rows: int, tree_rows: int, heads: int, batch: int,
                mixed: bool = False, kept: int = 0) -> float:
        """Tokens per second of a step of `batch` requests, `heads` of them drafting from the head, `mixed`
        if some decode plainly while others verify. The head's time: its extension over the drafting
        requests' rows (their share of the tokens) and its forwards; none where no request drafts from it
        (it extends over a request's rows only when it drafts for it: `Sequence.head_backlog`); first
        its catch-up over the `kept` rows of those requests (`_catch_up_seconds`)."""
        seconds = (self._target_seconds(arm, batch, chain_rows, tree_rows, mixed, self.cold(arm, batch))
                   + self.overhead_cost.predict([1.0, batch]))
        if heads:
            seconds += self.draft_cost.predict([1.0, tokens * heads / batch, *self._draft_work(arm, heads)])
            seconds += self._catch_up_seconds(kept)
        return tokens / max(seconds, 1e-9)

    def _catch_up_seconds(self, kept: int) -> float:
        """What drafting from the head costs first where it kept rows for those requests: a pass of its own
        over them. Unpriced, a head step after a stretch of plain steps looked as cheap as one in a run of
        head steps, and at 4 requests the policy went in and out of a chain of 1 (a few percent faster than
        plain decoding when run steadily) and ran below plain decoding (issue 43, docs/benchmarks.md
        "Adaptive speculation by default")."""
        return self.catch_up_cost.predict([1.0, kept]) if kept else 0.0

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
        step = self._target_seconds(Arm(0), batch, batch, 0)
        if step <= 0:
            return 1.0
        row = min(max(self.target_cost.theta[2], 0.0), step / batch)
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
            plan = padded if self.graphs_seen else max(plan, padded, key=lambda p: p.tokens_per_s)
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
        plans = [Plan(Arm(0), ["plain"] * batch)]
        plans[0].tokens_per_s = self.predict(Arm(0), batch, batch, 0, 0, batch) * self.correction("plain", batch)
        chains = [a.steps for a in self.arms if a.steps and not a.is_tree]
        plans += filter(None, (self._chain_plan(k, stats, found) for k in chains))
        if any(f is not None for f in found):
            plans += filter(None, (self._chain_plan(k, stats, found, lookup_only=True) for k in chains))
        heads = ["plain" if st and st.head_gap else "eagle3" for st in stats]
        if "eagle3" in heads:
            plans += [Plan(a, heads, self.price(a, heads, stats, worth=True, catch_up=True)
                           * self.correction(Plan(a, heads).family, batch)) for a in self.tree_tokens]
        return plans

    def _best(self, plans: list[Plan]) -> Plan:
        """What the policy runs of these (exploration aside): the fastest, if `EDGE` faster than plain, or
        `MARGIN` where a ragged finish can cost (several requests that started together, none queued: `choose`)."""
        best = max(plans, key=lambda p: p.tokens_per_s)
        return best if best.tokens_per_s >= (MARGIN if self._ragged else EDGE) * plans[0].tokens_per_s else plans[0]

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
        known = bool(remaining) and len(remaining) > 1 and None not in remaining
        # `MARGIN` where the batch thins out with nothing to refill it. Started apart, a client's next request
        # is likely to take a freed slot: at 4 requests so sent, the margin held a chain of 1 that ran faster
        # per step than plain decoding, but was predicted inside the margin, to plain on about a quarter of the
        # steps (traced: docs/benchmarks-journal.md, "The margin only for batches that started together: 4 requests").
        self._ragged = len(stats) > 1 and not queued and max(ages) - min(ages) <= TOGETHER
        self._together = known and self._ragged
        plan = self._decide(stats, found)
        plan.sources = [s if s != "eagle3" or not (st and st.head_gap) else "plain"
                        for s, st in zip(plan.sources, stats)]  # the warm-up's and exploration's too
        plan.raw_tokens_per_s = self.price(plan.arm, plan.sources, stats, found)
        plan.eager = self.graphs_seen and self.cold(plan.arm, len(stats))
        return plan

    def _decide(self, stats: list[PerRequest | None], found: list[list[int] | None]) -> Plan:
        self.decisions += 1
        batch = len(stats)
        if self.decisions <= len(self.arms):  # warm-up: every arm once, so every cost term is seen
            arm = self.arms[self.decisions - 1]
            return Plan(arm, ["eagle3" if arm.steps else "plain"] * batch, explored=True)
        found = found if self.ngram else [None] * batch
        if (self.graphs_seen and shape_key(Arm(0), batch) not in self.step_seconds
                and self.eager_runs.get(shape_key(Arm(0), batch), 0) < HOT_AFTER):
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
        runner_up = max((p.tokens_per_s for p in plans[1:]), default=0.0)
        self._held = (HOLD_STEPS - 1 if best is plans[0] and runner_up < HOLD * plain else 0), batch, plain
        if not explore:
            return best
        near = [p for p in plans if p is not best and (p is plans[0] or p.tokens_per_s >= 0.7 * best.tokens_per_s)
                and self._explorable(p.arm, batch)]  # plain decoding, the baseline, however far behind
        if near:
            return replace(self._rng.choice(near), explored=True)
        k = best.arm.steps if not best.arm.is_tree else self.steps
        ks = [x for x in (k - 1, k + 1) if 0 <= x <= self.steps and self._explorable(Arm(x), batch)]
        if not ks:
            return best
        k = self._rng.choice(ks)
        return Plan(Arm(k), ["eagle3" if k and not (st and st.head_gap) else "plain" for st in stats], explored=True)

    def _explorable(self, arm: Arm, batch: int) -> bool:
        """Worth an exploration step: the arm's last step at this batch ran through a graph, or a graph has
        compiled since it ran eagerly (its own shape, heated by its eager steps, may be the one: the step
        that finds it compiled prices the arm as a graph again). Otherwise, or never run at this batch (no
        graph can hold a shape never met), it would run eagerly, at up to 10 plain steps' time at 16
        requests (traced: 647 ms for a chain of 3 met for the first time, against 58 ms), teaching its
        correction nothing (`learn` skips a step priced as a graph that ran eagerly). An arm never run at a
        batch starts there only when chosen as the best: its steps in a row heat its shape."""
        if not arm.steps:  # the baseline: excluded after one eager step (the batch filling up), it was never
            return True  # chosen again where the lines favoured chains, at 0.6x plain's speed (in-process, 4 requests)
        key = shape_key(arm, batch)
        if key not in self.eager_runs:
            return False
        return not self.eager_runs[key] or self.compiled > self._eager_at.get(key, -1)

    def describe(self) -> str:
        """The periodic log line's part: estimates and what was chosen."""
        rates = " ".join(f"{r:.2f}" for r in self.eagle.rates())
        look = " ".join(f"{r:.2f}" for r in self.lookup.rates())
        top = ", ".join(f"{name} {n}" for name, n in self.chosen.most_common(3))
        return f"policy: chose {top}; eagle3 acceptance {rates}; ngram {look}"


def shape_key(arm: Arm, batch: int) -> tuple[Arm, int]:
    """The arm at the batch size its step's graph is padded to (tsengine/model/graphs.py `BATCH_BUCKETS`): the
    sizes of one bucket share a graph, so they share its eager record. Keyed by the exact size, a server
    whose batch filled up over its first steps met a chain of 1 "for the first time" at 9, 10, ... 16
    requests, ran each eagerly, and lost 2-6% of a round at 16 requests (issue 43)."""
    return arm, graph_batch(batch)


def graph_batch(batch: int) -> int:
    """The batch size a step of `batch` requests is padded to in its graph (itself past the largest bucket)."""
    return bucket(batch, BATCH_BUCKETS) or batch

