"""Adaptive speculation's policy alone (tsengine/speculative/adaptive/policy.py,
tsengine/speculative/adaptive/estimates.py, issue 15): the fitted costs and acceptance it measures, and the choices
it makes from them, on policies fed by hand. The engine-level tests (losslessness under any decisions, the head's
lazy extension) are tests/speculative/test_adaptive.py."""

from __future__ import annotations

import copy

import pytest

from tsengine.model.graphs import BATCH_BUCKETS, HOT_AFTER
from tsengine.sampling_params import SamplingParams
from tsengine.sequence import Sequence
from tsengine.speculative.adaptive.costs import HEAD_SAMPLES
from tsengine.speculative.adaptive.estimates import Acceptance, LinearCost, PerRequest, RunningMean
from tsengine.speculative.adaptive.plan import PAD, Arm, Plan
from tsengine.speculative.adaptive.policy import EDGE, HOLD, HOLD_STEPS, MARGIN, STAY, AdaptivePolicy
from tsengine.speculative.adaptive.proposer import known_remaining
from tsengine.speculative.drafts import Proposal


def test_linear_cost_recovers_a_line():
    model = LinearCost(("base", "per_row"), forget=1.0)
    for rows in range(1, 60):
        model.update([1.0, rows], 0.01 + 0.002 * rows)
    assert model.theta == pytest.approx([0.01, 0.002], rel=1e-3)
    assert model.predict([1.0, 100]) == pytest.approx(0.21, rel=1e-3)


def test_linear_cost_holds_still_on_one_shape():
    """With forgetting, 2,000 steps of one row count leave the other direction unexcited; the capped
    covariance keeps the fitted line where it was, so one step of another shape cannot swing it."""
    model = LinearCost(("base", "per_row"), forget=0.99)
    for rows in list(range(1, 30)) * 3:
        model.update([1.0, rows], 0.01 + 0.002 * rows)
    for _ in range(2000):
        model.update([1.0, 8], 0.01 + 0.002 * 8)
    model.update([1.0, 32], 0.01 + 0.002 * 32 + 0.005)  # one noisy step elsewhere
    assert model.predict([1.0, 4]) == pytest.approx(0.018, rel=0.1)
    assert max(model.p[i][i] for i in range(2)) <= model.prior


def test_acceptance_counts_the_accepted_run():
    a = Acceptance(3, prior=0)
    a.observe(3, 1)  # drafted 3, accepted 1: position 0 hit, 1 and 2 missed
    a.observe(2, 2)
    assert a.rates() == [1.0, 0.5, 0.0] and a.tokens(2) == 2.5
    r = PerRequest(3)
    for _ in range(50):
        r.observe("ngram", 3, 3)
    assert r.tokens("ngram", 3, Acceptance(3, prior_rate=0.1)) > 3.75 # its own record outweighs the average
    assert r.tokens("eagle3", 3, a) == pytest.approx(a.tokens(3))  # untried: the average


def trained_policy(draft_step_seconds: float, accepted: int = 3, ngram: bool = True,
                   row_seconds: float = 0.0001) -> AdaptivePolicy:
    """A policy whose models were fed: target 10 ms + `row_seconds` per row, compiled (an eager step 5 ms
    more); drafting `draft_step_seconds` per sequential head forward; the head's drafts accepted `accepted`
    of 3."""
    p = AdaptivePolicy(3, ngram=ngram)
    p.decisions, p.costs.graphs_seen = 100, True  # past warm-up, not on an exploration step
    for rows in range(1, 80):
        for eager in (0.0, 1.0):
            p.costs.target.update([1.0, eager, rows, 0.0], 0.010 + 0.005 * eager + row_seconds * rows)
        p.costs.target.update([1.0, 0.0, 1, rows * 4], 0.010 + row_seconds + 1.5 * row_seconds * rows * 4)
    for batch in (1, 2, 4, 8):
        for k in range(4):
            p.costs.draft.update([1.0, batch, k, k * batch], 0.001 + draft_step_seconds * k)
    for _ in range(200):
        p.eagle.observe(3, accepted)
    p.costs.eager_runs = {(arm, batch): 0 for arm in p.arms for batch in range(1, 65)}  # every shape compiled
    for size in BATCH_BUCKETS:  # plain decoding measured at every batch bucket (its graph padded to it)
        p.costs.step_seconds[Arm(0), size] = RunningMean()
        p.costs.step_seconds[Arm(0), size].observe(0.010 + row_seconds * size)
    return p


def test_the_policy_speculates_when_it_pays_and_not_when_it_does_not():
    plan = trained_policy(draft_step_seconds=0.0005).choose([None] * 4, [None] * 4)
    assert plan.arm == Arm(3) and plan.sources == ["eagle3"] * 4  # cheap, always accepted
    assert trained_policy(draft_step_seconds=0.05).choose([None] * 4, [None] * 4).arm == Arm(0)  # 5 target steps
    assert trained_policy(0.0005, accepted=0).choose([None] * 4, [None] * 4).arm == Arm(0)  # never accepted


def test_each_request_gets_the_source_that_pays_for_it():
    """The head is poor here; one request's prompt lookup has always been right, another's never: the
    first drafts by lookup, the others draft nothing worth their rows. Compiled, they pad the step to a
    uniform one (5 ms less than a mixed step's eager run, for 0.1 ms a row); eager, or where drafts without
    a q cannot be verified (the rejection rule: `ngram` off), they decode plainly."""
    good, bad = PerRequest(3), PerRequest(3)
    for _ in range(200):
        good.observe("ngram", 3, 3)
        bad.observe("ngram", 3, 0)
    stats, found = [good, bad, None, None], [[1, 2, 3], [4, 5, 6], None, None]
    p = trained_policy(draft_step_seconds=0.0005, accepted=0)
    plan = p.choose(stats, found)
    assert plan.arm.steps >= 2 and plan.sources == ["ngram", PAD, PAD, PAD], plan
    p.costs.graphs_seen = False
    assert p.choose(stats, found).sources == ["ngram", "plain", "plain", "plain"]
    assert p.price(Arm(3), ["ngram", PAD, PAD, PAD], stats, found) < p.price(Arm(3), ["ngram"] + ["plain"] * 3,
                                                                             stats, found)
    rejection = trained_policy(draft_step_seconds=0.0005, accepted=0, ngram=False)
    assert all(PAD not in plan.sources for plan in rejection.candidates(stats, [None] * 4))


def test_drafting_for_a_few_of_a_batch_that_ends_together_is_worth_only_their_rows():
    """Lookup offers a sure continuation to 2 of 8 requests. With requests queued, a request done sooner frees
    its slot: they draft. With none queued and all 8 equally long, the batch ends no sooner (the other six
    are as long): they decode plainly, unless one may stop at EOS (then any may be the last). Requests that
    started apart are counted per token (their slots are taken to be refilled): they draft again. Started
    together, they still end together when speculation has spread their remaining tokens."""
    p = trained_policy(draft_step_seconds=0.0005, accepted=0)
    # eager steps: the others decode plainly rather than pad (see the test above); plain decoding priced from
    # the line's eager term, as the others are
    p.costs.graphs_seen, p.costs.step_seconds = False, {}
    good = [PerRequest(3), PerRequest(3)]
    for _ in range(200):
        for st in good:
            st.observe("ngram", 3, 3)
    rest = [PerRequest(3) for _ in range(6)]
    stats, found = good + rest, [[1, 2, 3]] * 2 + [None] * 6
    assert p.choose(stats, found, [50] * 8, queued=2).sources == ["ngram"] * 2 + ["plain"] * 6
    assert p.choose(stats, found, [50] * 8).arm == Arm(0)
    assert p.choose(stats, found, [40, 40] + [50] * 6).arm == Arm(0)  # the lookup pair drew ahead
    assert p.choose(stats, found, [50] * 7 + [None]).sources[:2] == ["ngram"] * 2  # one may stop at EOS: any
    for st in rest:  # six requests admitted 20 steps later, as slots freed
        st.age -= 20
    assert p.choose(stats, found, [50] * 8).sources == ["ngram"] * 2 + ["plain"] * 6
    one = p.choose([good[0]], [[1, 2, 3]], [50])  # one request: every token it gains is the batch's
    assert one.sources == ["ngram"] and p._worth_ratio([2.0]) == 1.0
    ends = [Sequence(str(i), [1, 2], SamplingParams(max_tokens=9, ignore_eos=eos), 0) for i, eos in enumerate((1, 0))]
    assert [known_remaining(seq) for seq in ends] == [9, None]


def test_lookup_alone_wins_where_the_head_accepts_more_but_costs_its_forwards():
    """Per request the head commits more (3 of 3 against lookup's 2 of 3), but each head forward costs 20%
    of a target step and lookup costs nothing: the step drafts by lookup only."""
    p = trained_policy(draft_step_seconds=0.002, accepted=3)
    st = PerRequest(3)
    for _ in range(200):
        st.observe("ngram", 3, 2)
        st.observe("eagle3", 3, 3)
    assert p._chain_plan(3, [st], [[1, 2, 3]]).sources == ["eagle3"]  # by tokens alone: the head
    plan = p.choose([st], [[1, 2, 3]])
    assert plan.arm.steps >= 2 and plan.sources == ["ngram"], plan


def test_what_an_arm_delivers_corrects_its_prediction():
    """The lines say chain 3; its steps keep delivering 30% of the predicted tokens per second (say the head
    is poor on today's prompts): one correction serves every chain length drafting from the head
    (`Plan.family`), so the policy decodes plainly; prompt lookup's chains and trees keep their own."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    assert plan.arm == Arm(3) and plan.raw_tokens_per_s > 0
    for _ in range(120):
        p.learn_draft(16, plan, 0.002)
        seconds = 0.0116
        p.learn(Proposal(runs=[], aux=None, decode_rows=16, target_seconds=seconds, graph=True,
                         tokens=round(0.3 * plan.raw_tokens_per_s * (seconds + 0.002))))
    assert p.correction("chain", 4) == pytest.approx(0.3, abs=0.05)
    assert p.choose([None] * 4, [None] * 4).arm == Arm(0)
    assert p.correction("chain", 16) == p.correction("chain", 4)  # an unseen bucket borrows the nearest's
    assert p.correction("chain ngram", 4) == p.correction("plain", 4) == 1.0


def test_chain_lengths_are_told_apart_by_their_own_steps():
    """With one correction for all chain lengths, a length is priced from its own graph steps at its batch
    bucket (`step_seconds`) where it has them. Kept per length, the corrections wandered by ±10% where the
    lengths differed by 5-10%, and one request's server ran chains of 2 and 1 where 3 was fastest. Here the
    line says chain 3, but its steps at 4 requests take 30 ms: chain 2 runs there; at 16 requests chain 3,
    with no steps of its own, is still priced from the line."""
    p = trained_policy(draft_step_seconds=0.0005)
    assert p.choose([None] * 4, [None] * 4).arm == Arm(3)
    for _ in range(5):
        p.last = Plan(Arm(3), ["eagle3"] * 4)
        p.learn(Proposal(runs=[], aux=None, decode_rows=16, target_seconds=0.030, graph=True, tokens=12))
        p.learn(Proposal(runs=[], aux=None, decode_rows=15, target_seconds=0.090, graph=False, tokens=12))  # mixed
    assert p.costs.step_seconds[Arm(3), 4].value == pytest.approx(0.030)
    assert p.choose([None] * 4, [None] * 4).arm == Arm(2)
    assert p.choose([None] * 16, [None] * 16).arm == Arm(3)


def test_the_heads_time_is_priced_from_its_own_steps_at_each_shape():
    """The head's line is not identifiable where few shapes run, and off them it drifts: a server's priced a
    chain of 3 for 4 requests at no head time, and the one correction all chain lengths share then kept a
    chain of 1 that beat plain decoding from running. Each arm's record per batch bucket of the requests it
    drafts for prices that shape once it has `HEAD_SAMPLES` steps; a median, so the eager steps before its
    graph compiles leave it alone. Here chain 3's head takes 8 ms (the line says 2.5): chain 2 runs."""
    p = trained_policy(draft_step_seconds=0.0005)
    line = p.costs.head(Arm(3), 4, 4)
    assert line == pytest.approx(0.0025, rel=1e-3) and p.choose([None] * 4, [None] * 4).arm == Arm(3)
    plan, fitted = Plan(Arm(3), ["eagle3"] * 4), copy.deepcopy(p.costs.draft)
    for seconds in [0.030, 0.030] + [0.008] * (HEAD_SAMPLES - 3):  # two eager steps, then its graph's
        p.learn_draft(16, plan, seconds)
    assert p.costs.head(Arm(3), 4, 4) == p.costs.draft.predict([1.0, 4, 3, 12])  # too few steps yet: the line
    p.learn_draft(16, plan, 0.008)
    assert p.costs.head(Arm(3), 4, 4) == p.costs.head(Arm(3), 3, 3) == 0.008  # 3 requests pad to 4
    assert p.costs.head(Arm(3), 16, 16) != 0.008 and p.costs.head(Arm(2), 4, 4) != 0.008
    p.costs.draft = fitted  # the line as it was (it learned from these steps too): chain 2 priced as before
    assert p.choose([None] * 4, [None] * 4).arm == Arm(2)


def test_the_heads_first_eager_passes_at_a_shape_teach_no_cost_where_it_has_graphs():
    """The passes that heat a head graph (the first building kernels for new sizes) are not what the shape
    costs: a server's warm-up taught the head's line 386 ms for a chain of 3 and no chain ever ran at 4
    requests. Past `HOT_AFTER` eager passes in a row the shape is not compiling, and its eager time is its
    cost; with no head graphs at all (`graph` None) every pass teaches."""
    p = AdaptivePolicy(3)
    plan = Plan(Arm(1), ["eagle3"] * 4)
    for _ in range(HOT_AFTER):
        p.learn_draft(4, plan, 0.3, graph=False)
    assert p.costs.draft.samples == 0 and (Arm(1), 4) not in p.costs.head_seconds
    p.learn_draft(4, plan, 0.3, graph=False)
    assert p.costs.draft.samples == 1
    p.learn_draft(4, plan, 0.006, graph=True)  # a graph pass teaches, and the next eager one is a first again
    p.learn_draft(4, plan, 0.3, graph=False)
    assert p.costs.draft.samples == 2 and p.costs.head_seconds[Arm(1), 4].recent[-1] == 0.006
    eager_only = AdaptivePolicy(3)
    eager_only.learn_draft(4, plan, 0.3)
    assert eager_only.costs.draft.samples == 1


def test_a_step_timed_beside_a_compile_teaches_no_cost():
    """A compile shares the cores (in-process engines compile at once): a step timed beside one teaches the
    target's line, the shape's record and the correction nothing. One request's run fitted its line to
    63 ms + -9 ms a row so, and priced chains of 1 and 2 at half their speed. Acceptance is still learned."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    theta, records, ratio = list(p.costs.target.theta), dict(p.costs.step_seconds), p.correction("chain", 4)
    p.learn_draft(16, plan, 0.002)
    p.learn(Proposal(runs=[], aux=None, decode_rows=16, target_seconds=0.5, graph=True, tokens=4), quiet=False)
    assert p.costs.target.theta == theta and p.costs.step_seconds == records and p.correction("chain", 4) == ratio
    assert p.costs.eager_runs[Arm(3), 4] == 0  # it ran as a graph all the same
    p.learn(Proposal(runs=[], aux=None, decode_rows=16, target_seconds=0.5, graph=True, tokens=4))
    assert p.costs.target.theta != theta and p.costs.step_seconds[Arm(3), 4].value == 0.5


def test_a_plain_step_is_priced_from_its_own_record_at_its_batch_bucket():
    """Plain decoding's step is no point on the line through chain steps: one row runs another matmul kernel
    than two or more (tsengine/model/linear.py), here 10 ms where the line through 2..8-row steps starts at
    15 ms; at 4 requests a line fitted from chain steps put plain's 29 ms step at 46 ms and chains ran at
    0.92x plain through a server. Plain decoding is priced from its own graph steps at each batch bucket
    (3 requests pad to the graph of 4), learned from the steps it ran."""
    p = AdaptivePolicy(3)
    p.costs.graphs_seen = True
    for _ in range(20):
        for rows in range(2, 9):
            p.costs.target.update([1.0, 0.0, rows, 0.0], 0.015 + 0.001 * rows)
        for rows in (8, 12, 16):
            p.costs.target.update([1.0, 0.0, rows * 4, 0.0], 0.040 + 0.0005 * rows * 4)
        p.last = Plan(Arm(0), ["plain"])
        p.learn(Proposal(runs=[], aux=None, decode_rows=1, target_seconds=0.010, graph=True, tokens=1))
        p.last = Plan(Arm(0), ["plain"] * 4)
        p.learn(Proposal(runs=[], aux=None, decode_rows=4, target_seconds=0.029, graph=True, tokens=4))
        p.learn(Proposal(runs=[], aux=None, decode_rows=4, target_seconds=0.090, graph=False, tokens=4))  # eager
    assert p.predict(Arm(0), 1.0, 1, 0, 0, 1) == pytest.approx(100, rel=0.02)
    assert p.predict(Arm(1), 2.0, 2, 0, 0, 1) == pytest.approx(2 / p.costs.target.predict([1.0, 0.0, 2, 0.0]), rel=0.02)
    assert p.predict(Arm(0), 4.0, 4, 0, 0, 4) == pytest.approx(4 / 0.029, rel=0.02)
    assert p.predict(Arm(0), 3.0, 3, 0, 0, 3) == pytest.approx(3 / 0.029, rel=0.02)


def test_one_wild_prediction_does_not_pin_a_correction():
    """Lines fitted from a handful of steps can promise a million tokens per second: one such step, then 50
    steps that deliver what is predicted, leave the kind's correction near 1, not near 0."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    honest = plan.raw_tokens_per_s
    for step in range(51):
        plan.raw_tokens_per_s = 1e9 if step == 0 else honest
        p.learn_draft(16, plan, 0.002)
        p.learn(Proposal(runs=[], aux=None, decode_rows=16, target_seconds=0.0116, graph=True,
                         tokens=max(1, round(honest * 0.0136))))
    assert p.correction("chain", 4) > 0.8


def test_warm_up_and_cold_eager_steps_leave_corrections_alone():
    """A warm-up step (priced by lines fitted from nothing) and a step priced as a graph that ran eagerly
    only because its shape had no graph yet (tsengine/model/graphs.py `Heat`) teach an arm's correction
    nothing; the same step through its graph does, and so does an eager step priced as one."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    assert plan.arm == Arm(3)

    def step(graph: bool) -> None:
        p.learn_draft(16, plan, 0.002)
        p.learn(Proposal(runs=[], aux=None, decode_rows=16, target_seconds=0.0116, graph=graph,
                         tokens=max(1, round(0.3 * plan.raw_tokens_per_s * 0.0136))))

    step(graph=False)  # a chain of 3 for all 4 requests is uniform: eager only because it was cold
    assert p.correction("chain", 4) == 1.0
    decisions, p.decisions = p.decisions, len(p.arms)  # the last plan was the warm-up's last
    step(graph=True)
    assert p.correction("chain", 4) == 1.0
    p.decisions = decisions
    step(graph=True)
    assert p.correction("chain", 4) < 1.0
    # priced as the eager step it is (its last HOT_AFTER steps here ran eagerly), an eager step is what was
    # promised: its correction learns from it
    for k in (1, 2, 3):
        p.costs.eager_runs[Arm(k), 4] = HOT_AFTER
    plan = p.choose([None] * 4, [None] * 4)
    assert plan.eager == (plan.arm != Arm(0))
    plan = Plan(Arm(3), ["eagle3"] * 4, raw_tokens_per_s=p.price(Arm(3), ["eagle3"] * 4, [None] * 4), eager=True)
    before = p.correction("chain", 4)
    step(graph=False)
    assert p.correction("chain", 4) < before


def test_only_steps_that_draft_from_the_head_pay_for_it():
    """Head forwards cost 5 target steps each: plain decoding is chosen and priced as if there were no head
    (its extension is lazy: `Sequence.head_backlog`), and so is a step drafting by prompt lookup alone;
    a request with a hole in the head's cache never gets the head."""
    cheap, dear = trained_policy(draft_step_seconds=0.0005), trained_policy(draft_step_seconds=0.05)
    plain = dear.choose([None] * 4, [None] * 4)
    assert plain.arm == Arm(0) and plain.raw_tokens_per_s == pytest.approx(cheap.price(Arm(0), ["plain"] * 4,
                                                                                       [None] * 4))
    st = PerRequest(3)
    for _ in range(200):
        st.observe("ngram", 3, 3)
    lookup = dear.choose([st], [[1, 2, 3]])
    assert lookup.sources == ["ngram"]
    assert lookup.raw_tokens_per_s == pytest.approx(cheap.price(lookup.arm, ["ngram"], [st], [[1, 2, 3]]))
    gap = PerRequest(3)
    gap.head_gap = True
    assert all(s != "eagle3" for plan in cheap.candidates([gap, None], [None, [1, 2]]) for s in plan.sources[:1])
    plan = cheap.choose([gap, None, None, None], [None] * 4)
    assert plan.sources[0] in ("plain", PAD) and plan.sources[1:] == ["eagle3"] * 3  # the gap stays until a recompute


def test_a_step_mixing_plain_and_drafting_requests_is_priced_eager():
    """Prompt lookup has a continuation for 1 of 4 requests, worth one token. Drafting for it alone makes a
    mixed step, which runs eagerly (5 ms more here): slower than plain decoding. Padding the others' windows
    keeps the step compiled: where rows are cheap (0.1 ms) that beats plain; where they are dear (3 ms, as at
    4 requests on this CPU) the 9 padding rows cost more than the token: plain decoding. With a continuation
    for all 4 the step is uniform anyway and lookup pays."""
    st = PerRequest(3)
    for _ in range(200):
        st.observe("ngram", 3, 1)
    stats, one = [st] * 4, [[1, 2, 3], None, None, None]
    for row_seconds, padding_pays in ((0.0001, True), (0.003, False)):
        p = trained_policy(draft_step_seconds=0.0005, accepted=0, row_seconds=row_seconds)
        plain = p.candidates(stats, one)[0]
        assert p.price(Arm(3), ["ngram", "plain", "plain", "plain"], stats, one) < plain.tokens_per_s  # mixed
        chosen = p.choose(stats, one)
        assert chosen.sources == (["ngram", PAD, PAD, PAD] if padding_pays else ["plain"] * 4), (row_seconds, chosen)
    assert trained_policy(draft_step_seconds=0.0005, accepted=0).choose(stats, [[1, 2, 3]] * 4).sources == ["ngram"] * 4


def test_the_margin_over_plain_holds_only_where_the_batch_thins_out_unrefilled():
    """A chain predicted 3% faster than plain decoding: for 4 requests that started together with none
    queued (the batch thins out as they finish), below `MARGIN`: plain. Started apart (a client refilling
    freed slots) or with requests queued: the chain."""
    p = AdaptivePolicy(3)
    p.decisions = 100
    p.candidates = lambda stats, found: [Plan(Arm(0), ["plain"] * 4, 100.0), Plan(Arm(1), ["eagle3"] * 4, 103.0)]
    together = [PerRequest(3) for _ in range(4)]
    assert p.choose(together, [None] * 4).arm == Arm(0)
    assert p.choose(together, [None] * 4, queued=1).arm == Arm(1)
    together[0].age += 20
    assert p.choose(together, [None] * 4).arm == Arm(1)


def test_a_batch_whose_freed_slots_are_refilled_at_once_is_not_held_to_the_margin():
    """Four clients with equally long requests: decoding plainly, each wave ends at one step and the next
    starts at one, so ages alone say "started together". Once departures are seen followed by arrivals
    within `Refills.within_s`, the chain predicted 3% ahead runs (`EDGE`, not `MARGIN`); once freed slots
    mostly stay empty (bursts that ended, the next one long after), the margin holds again."""
    p = AdaptivePolicy(3)
    p.decisions, p.explore_every = 100, 10**6
    p.candidates = lambda stats, found: [Plan(Arm(0), ["plain"] * 4, 100.0), Plan(Arm(1), ["eagle3"] * 4, 103.5)]
    now = [0.0]
    p.clock = lambda: now[0]

    def wave(start: float, steps: int = 5) -> list[Arm]:
        batch, arms = [PerRequest(3) for _ in range(4)], []
        for i in range(steps):
            now[0] = start + 0.05 * i
            arms.append(p.choose(batch, [None] * 4).arm)
        return arms

    assert wave(0.0) == [Arm(0)] * 5  # nothing seen refilled yet: the margin
    assert wave(0.3)[-1] == Arm(1)  # the first wave's four slots taken within 0.1 s
    assert wave(0.6)[-1] == Arm(1)
    bursts = [wave(60.0 * i)[-1] for i in range(1, 4)]  # slots left empty for a minute: new bursts, not refills
    assert bursts[0] == Arm(1) and bursts[-1] == Arm(0) and not p.refills.likely  # one empty wave is no trend


def test_an_arm_whose_steps_keep_running_eagerly_is_priced_as_eager():
    """A chain of 1 wins narrowly as a compiled step. Never run at this batch, it is priced as the graph it
    becomes once chosen (its first `HOT_AFTER` steps heat its shape: tsengine/model/graphs.py `Heat`), so it
    is chosen. After `HOT_AFTER` eager steps in a row with no graph step (chosen too rarely for its shape to
    compile), it is priced with the eager term and plain decoding wins; seen compiled again, the chain is back."""
    p = trained_policy(draft_step_seconds=0.004, accepted=1)
    p.costs.eager_runs = {}
    for k in (2, 3):
        p.costs.eager_runs[Arm(k), 4] = HOT_AFTER
    eager = Proposal(runs=[], aux=None, decode_rows=8, target_seconds=0.02, graph=False, tokens=6)
    for _ in range(HOT_AFTER):
        assert not p.costs.cold(Arm(1), 4)
        assert p.choose([None] * 4, [None] * 4).arm == Arm(1)
        p.last = Plan(Arm(1), ["eagle3"] * 4)
        p.learn(eager)
    assert p.costs.cold(Arm(1), 4) and not p.costs.cold(Arm(1), 2) and not p.costs.cold(Arm(0), 4)
    assert p.costs.cold(Arm(1), 3)  # 3 requests pad to the graph of 4: the same record
    assert p.choose([None] * 4, [None] * 4).arm == Arm(0)
    p.learn(Proposal(runs=[], aux=None, decode_rows=8, target_seconds=0.012, graph=True, tokens=6))
    assert not p.costs.cold(Arm(1), 4)
    assert p.choose([None] * 4, [None] * 4).arm == Arm(1)


def test_drafting_from_the_head_after_plain_steps_is_charged_its_catch_up():
    """The head's catch-up over rows it kept while plain steps ran is a pass of its own, paid by the step
    that next drafts from it: a chain that wins narrowly in a run of head steps loses to plain decoding when
    it would first catch up over 40 kept rows a request (2 ms + 0.1 ms a row, learned from catch-ups).
    Rows kept for requests that do not draft from the head cost the plan nothing."""
    def policy():  # each decision on its own: plain far ahead would hold the next few (`HOLD`)
        p = trained_policy(draft_step_seconds=0.002, accepted=1)
        for rows in range(1, 200, 7):
            p.costs.catch_up.update([1.0, rows], 0.002 + 0.0001 * rows)
        return p

    fresh = [PerRequest(3) for _ in range(4)]
    assert policy().choose(fresh, [None] * 4).arm == Arm(1)
    assert policy().choose(fresh, [None] * 4, kept=[40] * 4).arm == Arm(0)
    p = policy()
    bare = p.price(Arm(1), ["eagle3"] * 4, fresh, catch_up=True)
    assert p.price(Arm(1), ["eagle3"] * 4, fresh) == bare  # the correction's view: never the catch-up
    p._kept = [40] * 4
    dear = p.price(Arm(1), ["eagle3"] * 4, fresh, catch_up=True)
    assert p.price(Arm(1), ["plain"] * 4, fresh, catch_up=True) == p.price(Arm(1), ["plain"] * 4, fresh)
    # seconds = tokens / (tokens per second): 160 rows at 0.1 ms and the 2 ms pass, over the same tokens
    assert 1 / dear - 1 / bare == pytest.approx((0.002 + 0.016) / (4 * p.eagle.tokens(1)), rel=0.05)


def test_plain_decoding_far_ahead_is_held_a_few_steps_without_pricing():
    """Plain decoding predicted more than 10% faster than every other plan: the next `HOLD_STEPS` - 1
    decisions at that batch size are plain without pricing the candidates; another batch size, or plain
    only narrowly ahead, prices every step."""
    p = trained_policy(draft_step_seconds=0.05)  # drafting costs 5 target steps: plain far ahead
    priced, candidates = [], p.candidates
    p.candidates = lambda *a: priced.append(len(a[0])) or candidates(*a)
    for _ in range(2 * HOLD_STEPS):
        assert p.choose([None] * 4, [None] * 4).arm == Arm(0)
    assert priced == [4, 4]
    assert p.choose([None] * 2, [None] * 2).arm == Arm(0) and priced == [4, 4, 2]
    close = trained_policy(draft_step_seconds=0.01, accepted=1)  # plain ahead, not by 10%
    priced, candidates = [], close.candidates
    close.candidates = lambda *a: priced.append(len(a[0])) or candidates(*a)
    plans = candidates([None] * 4, [None] * 4)
    assert plans[0].tokens_per_s > max(q.tokens_per_s for q in plans[1:]) > HOLD * plans[0].tokens_per_s
    for _ in range(HOLD_STEPS):
        assert close.choose([None] * 4, [None] * 4).arm == Arm(0)
    assert priced == [4] * HOLD_STEPS


def test_exploration_skips_arms_whose_last_step_at_this_batch_ran_eagerly():
    """An exploration step on an arm that runs eagerly costs several graph steps and teaches its correction
    nothing (cold steps are skipped): exploring picks only chains and trees not last seen eager at this
    batch (plain decoding, the baseline, always may be), and with none such it runs the best plan, until a
    graph compiles (it may be the arm's: then it is explored)."""
    p = trained_policy(draft_step_seconds=0.002, accepted=2)
    p.explore_every = 1  # every decision explores
    best = p._best(p.candidates([None] * 4, [None] * 4)).arm
    explored = {p.choose([None] * 4, [None] * 4).arm for _ in range(40)}
    assert len(explored) > 1 and best in (Arm(2), Arm(3))  # runners-up get explored
    eager = Proposal(runs=[], aux=None, decode_rows=8, target_seconds=0.02, graph=False, tokens=4)
    for arm in p.arms:
        if arm != best:
            p.last = Plan(arm, ["eagle3" if arm.steps else "plain"] * 4)
            p.learn(eager)
    assert {p.choose([None] * 4, [None] * 4).arm for _ in range(40)} <= {best, Arm(0)}
    assert {p.choose([None] * 2, [None] * 2).arm for _ in range(40)} != {best}  # another batch: explored
    for arm in p.arms:
        del p.costs.eager_runs[arm, 8]  # never run at 5..8 requests: not explored (no graph holds a shape never met)
    five = p._best(p.candidates([None] * 5, [None] * 5)).arm
    assert {p.choose([None] * 5, [None] * 5).arm for _ in range(40)} <= {five, Arm(0)}
    p.costs.compiled += 1  # a graph compiled since those eager steps
    assert {p.choose([None] * 4, [None] * 4).arm for _ in range(40)} - {best, Arm(0)}


def test_plain_decoding_is_explored_after_an_eager_step_and_however_far_behind():
    """Plain decoding is the baseline every prediction is weighed against: exploration keeps measuring it
    even where its last step at this batch ran eagerly (the batch filling up), and when it is predicted
    below 70% of the best. Excluded like a chain, it was never chosen again where the lines favoured
    chains: 0.6x plain's speed (in-process, 4 requests), 0.92x through a server."""
    p = trained_policy(draft_step_seconds=0.002, accepted=1)
    p.explore_every = 1
    plans = p.candidates([None] * 4, [None] * 4)
    assert p._best(plans).arm == Arm(1) and plans[0].tokens_per_s < 0.7 * p._best(plans).tokens_per_s
    p.last = Plan(Arm(0), ["plain"] * 4)
    p.learn(Proposal(runs=[], aux=None, decode_rows=4, target_seconds=0.02, graph=False, tokens=4))
    assert p.costs.eager_runs[Arm(0), 4] == 1
    assert Arm(0) in {p.choose([None] * 4, [None] * 4).arm for _ in range(40)}


def test_plain_decoding_is_measured_first_at_each_batch_bucket():
    """Where steps run as graphs and plain decoding has no step of its own at a batch bucket yet, it runs
    first (up to `HOT_AFTER` eager steps, which heat its shape for a compile), however the lines favour
    chains: priced from the line through chain steps, it was never chosen at 4 requests."""
    p = trained_policy(draft_step_seconds=0.002, accepted=1)
    del p.costs.step_seconds[Arm(0), 8]
    assert p.choose([None] * 4, [None] * 4).arm == Arm(1)  # measured at 4
    eager = Proposal(runs=[], aux=None, decode_rows=6, target_seconds=0.05, graph=False, tokens=6)
    for _ in range(HOT_AFTER):
        plan = p.choose([None] * 6, [None] * 6)
        assert plan.arm == Arm(0) and plan.explored
        p.last = plan
        p.learn(eager)  # ran eagerly: no record yet
    assert (Arm(0), 8) not in p.costs.step_seconds and p.choose([None] * 6, [None] * 6).arm == Arm(1)
    p.last = Plan(Arm(0), ["plain"] * 6)
    p.learn(Proposal(runs=[], aux=None, decode_rows=6, target_seconds=0.0105, graph=True, tokens=6))
    assert p.costs.step_seconds[Arm(0), 8].value == 0.0105  # a graph step: its record (3..8 requests pad to 8)


def test_speculation_must_be_predicted_an_edge_faster_than_plain_decoding():
    """A chain predicted 1-3% ahead of plain decoding is not worth its switching costs (at 4 requests a
    server mixing such chains with plain steps ran at 0.97x plain): plain runs below `EDGE`, the chain
    above it, and `MARGIN` where a batch that started together thins out."""
    p = AdaptivePolicy(3)

    def best(ahead: float) -> Arm:
        return p._best([Plan(Arm(0), ["plain"] * 4, 100.0), Plan(Arm(1), ["eagle3"] * 4, 100.0 * ahead)]).arm

    assert 1.0 < EDGE < MARGIN
    assert best(EDGE - 0.01) == Arm(0) and best(EDGE + 0.001) == Arm(1)
    p._ragged = True
    assert best(EDGE + 0.001) == Arm(0) and best(MARGIN + 0.001) == Arm(1)


def test_a_kind_once_chosen_stays_while_predicted_level_with_plain():
    """Hysteresis: a chain is entered only when predicted `EDGE` ahead of plain decoding, then kept while
    predicted at least `STAY`, and left below it; plain decoding is then the incumbent and the chain must
    clear `EDGE` again. With one threshold, a chain predicted around it ran on some steps and not others
    (the ninth server run at 4 requests: 0.97x plain where the pinned chain of 1 ran 1.03x)."""
    p = trained_policy(draft_step_seconds=0.0005)
    p.explore_every = 10**6  # no exploration steps in between
    ahead = 1.0

    def decide() -> Arm:
        p.candidates = lambda stats, found: [Plan(Arm(0), ["plain"] * 4, 100.0),
                                             Plan(Arm(1), ["eagle3"] * 4, 100.0 * ahead)]
        return p._decide([None] * 4, [None] * 4).arm

    assert STAY < EDGE
    got = []
    for ahead in (EDGE - 0.005, EDGE + 0.005, (STAY + EDGE) / 2, STAY + 0.001, STAY - 0.005, (STAY + EDGE) / 2):
        got.append(decide())
    assert got == [Arm(0), Arm(1), Arm(1), Arm(1), Arm(0), Arm(0)]


def test_where_steps_run_as_graphs_no_step_mixes_plain_and_drafting_requests():
    """One request's prompt lookup is always right, the others have nothing to draft, and rows are dear: a
    step drafting for that request alone is priced faster than plain decoding, padding the others is not.
    Eager engines run that mixed step; where steps run as graphs it would be eager, dearer than priced (a
    new row count builds its kernels on the spot), so the policy pads or decodes plainly, never mixes."""
    st = PerRequest(3)
    for _ in range(200):
        st.observe("ngram", 3, 3)
    stats, one = [st] * 4, [[1, 2, 3], None, None, None]
    for graphs in (False, True):
        p = trained_policy(draft_step_seconds=0.0005, accepted=0, row_seconds=0.003)
        p.costs.graphs_seen = graphs
        mixed = p.price(Arm(3), ["ngram", "plain", "plain", "plain"], stats, one)
        assert mixed > MARGIN * p.candidates(stats, one)[0].tokens_per_s  # priced above plain decoding
        sources = p.choose(stats, one).sources
        assert (0 < sources.count("plain") < 4) == (not graphs), (graphs, sources)
