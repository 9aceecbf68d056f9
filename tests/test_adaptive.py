"""Adaptive speculation (tsengine/spec/adaptive.py, issue 15): lossless under any decisions (plain, chains,
trees, prompt lookup, per-request sources), and a policy that follows what it measures."""

from __future__ import annotations

import random
import time

import pytest
import torch
from prometheus_client import generate_latest

from tests.helpers import PROMPTS, make_llm, serving
from tsengine.config import EngineConfig, SpeculativeConfig
from tsengine.errors import UserError
from tsengine.llm import LLM
from tsengine.prometheus import PrometheusMetrics
from tsengine.sampling import SamplingParams
from tsengine.sequence import Sequence
from tsengine.spec.adaptive import PAD, AdaptivePolicy, Arm, Plan, stats
from tsengine.spec.adaptive_proposer import AdaptiveProposer, known_remaining
from tsengine.spec.drafts import Committed, Proposal
from tsengine.spec.estimates import Acceptance, LinearCost, PerRequest

PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=4, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]


def adaptive_llm(tiny_dirs, head, tree: bool = False, **kw) -> LLM:
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    spec = {"method": "auto", "model": str(head), "num_speculative_tokens": 3}
    if tree:
        spec.update(eagle_topk=2, num_draft_tokens=6)
    return LLM(str(tiny_dirs["llama"]), speculative_config=spec, **kw)


def random_plans(policy: AdaptivePolicy, rng: random.Random):
    """A `choose` that ignores every estimate: a random arm, and per request a random source among those
    it has (prompt lookup only where its tokens offer a continuation; a padded chain anywhere)."""

    def choose(stats, found, remaining=None, queued=0):
        arm = rng.choice(policy.arms)
        if arm.is_tree or not arm.steps:
            return Plan(arm, ["eagle3" if arm.steps else "plain"] * len(found))
        return Plan(arm, [rng.choice(["eagle3", "plain", PAD] + (["ngram"] if f else [])) for f in found])

    return choose


@pytest.mark.parametrize("blocks", [None, 40], ids=["roomy", "preempting"])
def test_any_decisions_keep_plain_outputs(tiny_dirs, heads, blocks):
    """Random plans forced through the test hook (plain, chains 1..3, a 3x2x6 tree; per request the head,
    prompt lookup, its last token repeated or nothing), a mixed greedy/seeded batch, chunked prefill and (40 blocks) preemption:
    every token is plain decoding's."""
    kw = {"num_kv_blocks": blocks, "max_model_len": 128} if blocks else {}
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs, **kw).generate(PROMPTS, PARAMS)]
    llm = adaptive_llm(tiny_dirs, heads["llama"], tree=True, **kw)
    policy = llm.engine.proposer.policy
    policy.choose = random_plans(policy, random.Random(7))
    proposer = llm.engine.proposer
    caught, real_catch_up = [0], proposer._catch_up

    def catch_up(runs):  # counts the runs the head extends over with rows kept since it last drafted
        caught[0] += sum(c.seq.spec_stats.backlog.rows > 0 for c in runs)
        return real_catch_up(runs)

    proposer._catch_up = catch_up
    scheduler, preempted = llm.engine.scheduler, []
    real_preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq), real_preempt(seq))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == want
    assert {"plain", "chain 1", "chain 3", "tree 3x2x6"} <= set(policy.chosen), policy.chosen
    assert caught[0] > 1, caught
    assert policy.drafted_by["ngram"] > 0 and policy.drafted_by["eagle3"] > 0 and policy.drafted_by[PAD] > 0, policy.drafted_by
    stats = llm.engine.stats
    assert stats.num_drafts > 0 and stats.drafted_per_pos[0] > stats.drafted_per_pos[2] > 0, (stats.num_drafts, stats.drafted_per_pos, policy.drafted_by, caught)
    assert bool(preempted) == bool(blocks), len(preempted)


def test_the_policy_runs_unforced_and_stays_lossless(tiny_dirs, heads):
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs).generate(PROMPTS * 2, PARAMS * 2)]
    llm = adaptive_llm(tiny_dirs, heads["llama"], tree=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, PARAMS * 2)] == want
    p = llm.engine.proposer.policy
    assert p.target_cost.samples > 10 and p.draft_cost.samples > 0  # the head learns from its drafting steps only
    assert sum(p.chosen.values()) == p.decisions
    text = generate_latest(PrometheusMetrics(llm.engine).registry).decode()
    for family in ("spec_decode_draft_length", "spec_decode_acceptance_estimate{position=\"0\",source=\"ngram\"}",
                   "spec_decode_tree_tokens_estimate{shape=\"3x2x6\"}", "spec_decode_cost_model_seconds",
                   "spec_decode_policy_steps_total", "spec_decode_policy_requests_total", "spec_decode_prediction_ratio",
                   "spec_decode_num_drafted_tokens_per_pos_total"):
        assert f"tsengine:{family}" in text, family
    assert "policy: chose" in p.describe()


def test_the_server_runs_the_policy(tiny_dirs, heads):
    """Through `serve`: concurrent greedy completions equal plain decoding's, and /metrics shows the policy."""
    prompts = ["the water is", "once upon a time", "a b a b a b a"]
    want = [o.outputs[0].text for o in make_llm(tiny_dirs).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    spec = SpeculativeConfig.resolve(config_json={"method": "auto", "model": str(heads["llama"]),
                                                  "num_speculative_tokens": 3, "eagle_topk": 2, "num_draft_tokens": 6})
    config = EngineConfig.make(model=str(tiny_dirs["llama"]), block_size=4, debug_checks=True, speculative=spec)
    with serving(config, "tiny", None) as server:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: server.client.completions.create(
                model="tiny", prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}).choices[0].text,
                prompts))
        metrics = server.client._client.get(server.url + "/metrics").text
    assert got == want
    assert "tsengine:spec_decode_policy_steps_total{choice=" in metrics
    assert "tsengine:spec_decode_cost_model_seconds{part=\"target\",term=\"per_chain_row\"}" in metrics
    assert "tsengine:spec_decode_cost_model_seconds{part=\"overhead\",term=\"per_request\"}" in metrics
    assert "tsengine:compiled_graphs_total " in metrics


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
    assert float(model.p.diagonal().max()) <= model.prior


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
    p.decisions, p.graphs_seen = 100, True  # past warm-up, not on an exploration step
    for rows in range(1, 80):
        for eager in (0.0, 1.0):
            p.target_cost.update([1.0, eager, rows, 0.0], 0.010 + 0.005 * eager + row_seconds * rows)
        p.target_cost.update([1.0, 0.0, 1, rows * 4], 0.010 + row_seconds + 1.5 * row_seconds * rows * 4)
    for batch in (1, 2, 4, 8):
        for k in range(4):
            p.draft_cost.update([1.0, batch, k, k * batch], 0.001 + draft_step_seconds * k)
    for _ in range(200):
        p.eagle.observe(3, accepted)
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
    p.graphs_seen = False
    assert p.choose(stats, found).sources == ["ngram", "plain", "plain", "plain"]
    assert p.price(Arm(3), ["ngram", PAD, PAD, PAD], stats, found) < p.price(Arm(3), ["ngram"] + ["plain"] * 3, stats, found)
    rejection = trained_policy(draft_step_seconds=0.0005, accepted=0, ngram=False)
    assert all(PAD not in plan.sources for plan in rejection.candidates(stats, [None] * 4))


def test_drafting_for_a_few_of_a_batch_that_ends_together_is_worth_only_their_rows():
    """Lookup offers a sure continuation to 2 of 8 requests. With requests queued, a request done sooner frees
    its slot: they draft. With none queued and all 8 equally long, the batch ends no sooner (the other six
    are as long): they decode plainly, unless one may stop at EOS (then any may be the last). Requests that
    started apart are counted per token (their slots are taken to be refilled): they draft again. Started
    together, they still end together when speculation has spread their remaining tokens."""
    p = trained_policy(draft_step_seconds=0.0005, accepted=0)
    p.graphs_seen = False  # eager steps: the others decode plainly rather than pad (see the test above)
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
    """The lines say chain 3; its steps keep delivering half the predicted tokens per second (say the head
    is poor on today's prompts): the policy moves to the next best arm."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    assert plan.arm == Arm(3) and plan.raw_tokens_per_s > 0
    for _ in range(120):
        p.learn_draft(16, plan, 0.002)
        seconds = 0.0116
        p.learn(Proposal([], None, decode_rows=16, target_seconds=seconds, graph=True,
                         tokens=round(0.5 * plan.raw_tokens_per_s * (seconds + 0.002))))
    assert p.correction("chain 3", 4) == pytest.approx(0.5, abs=0.05)
    assert p.choose([None] * 4, [None] * 4).arm == Arm(2)
    assert p.correction("chain 3", 16) == p.correction("chain 3", 4)  # an unseen bucket borrows the nearest's
    assert p.correction("chain 1", 4) == p.correction("chain 3 ngram", 4) == 1.0


def test_a_one_row_step_is_priced_from_its_own_record():
    """One row runs another matmul kernel than two or more (tsengine/linear.py): here 10 ms, while the line
    through 2..8-row steps starts at 15 ms. Plain decoding at batch 1 is priced at 10 ms, not 16."""
    p = AdaptivePolicy(3)
    p.graphs_seen = True
    for _ in range(20):
        for rows in range(2, 9):
            p.target_cost.update([1.0, 0.0, rows, 0.0], 0.015 + 0.001 * rows)
        p.one_row.observe(0.010)
    assert p.predict(Arm(0), 1.0, 1, 0, 0, 1) == pytest.approx(100, rel=0.02)
    assert p.predict(Arm(1), 2.0, 2, 0, 0, 1) == pytest.approx(2 / 0.017, rel=0.02)


def test_one_wild_prediction_does_not_pin_a_correction():
    """Lines fitted from a handful of steps can promise a million tokens per second: one such step, then 50
    steps that deliver what is predicted, leave the kind's correction near 1, not near 0."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    honest = plan.raw_tokens_per_s
    for step in range(51):
        plan.raw_tokens_per_s = 1e9 if step == 0 else honest
        p.learn_draft(16, plan, 0.002)
        p.learn(Proposal([], None, decode_rows=16, target_seconds=0.0116, graph=True,
                         tokens=max(1, round(honest * 0.0136))))
    assert p.correction("chain 3", 4) > 0.8


def test_warm_up_and_cold_eager_steps_leave_corrections_alone():
    """A warm-up step (priced by lines fitted from nothing) and a step that ran eagerly only because its
    shape had no graph yet (tsengine/graphs.py `Heat`) teach an arm's correction nothing; the same step
    through its graph does."""
    p = trained_policy(draft_step_seconds=0.0005)
    plan = p.choose([None] * 4, [None] * 4)
    assert plan.arm == Arm(3)

    def step(graph: bool) -> None:
        p.learn_draft(16, plan, 0.002)
        p.learn(Proposal([], None, decode_rows=16, target_seconds=0.0116, graph=graph,
                         tokens=max(1, round(0.3 * plan.raw_tokens_per_s * 0.0136))))

    step(graph=False)  # a chain of 3 for all 4 requests is uniform: eager only because it was cold
    assert p.correction("chain 3", 4) == 1.0
    decisions, p.decisions = p.decisions, len(p.arms)  # the last plan was the warm-up's last
    step(graph=True)
    assert p.correction("chain 3", 4) == 1.0
    p.decisions = decisions
    step(graph=True)
    assert p.correction("chain 3", 4) < 1.0


def test_only_steps_that_draft_from_the_head_pay_for_it():
    """Head forwards cost 5 target steps each: plain decoding is chosen and priced as if there were no head
    (its extension is lazy: adaptive_proposer.Backlog), and so is a step drafting by prompt lookup alone;
    a request with a hole in the head's cache never gets the head."""
    cheap, dear = trained_policy(draft_step_seconds=0.0005), trained_policy(draft_step_seconds=0.05)
    plain = dear.choose([None] * 4, [None] * 4)
    assert plain.arm == Arm(0) and plain.raw_tokens_per_s == pytest.approx(cheap.price(Arm(0), ["plain"] * 4, [None] * 4))
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


def test_config_forms():
    auto = SpeculativeConfig.resolve(config_json={"method": "auto", "model": "HEAD", "num_speculative_tokens": 4})
    assert auto.algorithm == "EAGLE3" and auto.adaptive and auto.num_steps == 4
    flag = SpeculativeConfig.resolve(algorithm="EAGLE3", draft_model_path="HEAD", adaptive=True)
    assert flag.adaptive
    tree = SpeculativeConfig.resolve(algorithm="EAGLE3", draft_model_path="HEAD", adaptive=True, eagle_topk=8,
                                     num_steps=5, num_draft_tokens=32)
    assert [a.name for a in AdaptivePolicy(tree.num_steps, (5, 8, 32)).arms][-2:] == ["tree 5x8x32", "tree 3x2x6"]
    with pytest.raises(UserError, match="adaptive speculation chooses among"):
        SpeculativeConfig.resolve(algorithm="NGRAM", adaptive=True)


class RecordingHead:
    """Stands for the EAGLE-3 proposer: records the runs (and their features) it was asked to extend over."""

    extended: list = []
    catch_up_seconds = 0.0  # how long a pass over kept rows only (no run drafts next) takes

    def propose(self, proposal, only=None, **shape):
        self.extended = self.extended + [(c.seq.request_id, c.start, proposal.aux[c.rows].tolist()
                                          if proposal.aux is not None else None) for c in proposal.runs]
        for c in proposal.runs:
            c.seq.draft_cached = c.start + len(c.rows)
        if not any(c.drafts_next for c in proposal.runs):
            time.sleep(self.catch_up_seconds)
        return [None] * len(only or [])


class NoLookup:
    def lookup(self, seq):
        return None


def forced(proposer: AdaptiveProposer, sources: list[str], steps: int = 1) -> None:
    """Every decision of `proposer` is a chain of `steps` with these per-request sources."""
    proposer.policy.choose = lambda st, found, remaining=None, queued=0: Plan(Arm(steps), list(sources))


def test_the_head_extends_only_over_requests_it_can_draft_for():
    """A request with a hole in the head's cache (`head_gap`) never drafts from it again (until a
    recompute): the head's extension is not spent on that request's rows."""
    head = RecordingHead()
    proposer = AdaptiveProposer(head, NoLookup(), 3)
    forced(proposer, ["eagle3", "eagle3"])
    skipped, fresh = (Sequence(r, [1] * 10, SamplingParams(max_tokens=8), 0) for r in ("skipped", "fresh"))
    skipped.num_cached, skipped.draft_cached = 9, 4
    stats(skipped, 3).head_gap = True
    runs = [Committed(skipped, 8, [0], True), Committed(fresh, 0, list(range(1, 10)), True)]
    proposer.propose(Proposal(runs, torch.zeros(10, 2), decode_rows=1, prefill_rows=9))
    assert [r for r, _, _ in head.extended] == ["fresh"]


def test_the_head_extends_over_a_request_when_it_drafts_for_it_and_keeps_its_features_until_then(monkeypatch):
    """A step that does not draft for a request from the head (plain, prompt lookup, the head off) keeps
    the run's target features; the step that does extends over the kept rows and its own in one run from
    where the head's cache ends, with those very features. Past `BACKLOG_ROWS` kept rows it catches up
    without drafting; a run from where the head's cache ends starts afresh."""
    import tsengine.spec.adaptive_proposer as module

    monkeypatch.setattr(module, "BACKLOG_ROWS", 6)
    head = RecordingHead()
    proposer = AdaptiveProposer(head, NoLookup(), 3)
    seqs = [Sequence(r, list(range(20)), SamplingParams(max_tokens=8), 0) for r in ("kept", "long")]

    def step(start: dict[str, int], rows_of: dict[str, int], sources: list[str]):
        forced(proposer, sources)
        head.extended = []
        runs, aux = [], []  # every run's features: its position, as a row of 2 values
        for seq in seqs:
            n = rows_of[seq.request_id]
            runs.append(Committed(seq, start[seq.request_id], list(range(len(aux), len(aux) + n)), True))
            aux += [[float(start[seq.request_id] + i)] * 2 for i in range(n)]
        proposer.propose(Proposal(runs, torch.tensor(aux), decode_rows=2))
        return [(r, s) for r, s, _ in head.extended]

    assert step({"kept": 0, "long": 0}, {"kept": 2, "long": 2}, ["eagle3", "plain"]) == [("kept", 0)]
    assert step({"kept": 2, "long": 2}, {"kept": 1, "long": 4}, ["plain", "ngram"]) == []
    assert stats(seqs[1], 3).backlog.rows == 6
    assert step({"kept": 3, "long": 6}, {"kept": 1, "long": 4}, ["plain", "plain"]) == [("long", 0), ("long", 6)]
    assert [e[2] for e in head.extended] == [[[float(p)] * 2 for p in r] for r in (range(6), range(6, 10))]
    assert seqs[1].draft_cached == 10  # 10 kept rows > 6: caught up (the kept ones first), without drafting
    assert step({"kept": 4, "long": 10}, {"kept": 1, "long": 1}, ["plain", "plain"]) == []
    assert step({"kept": 5, "long": 11}, {"kept": 1, "long": 1}, ["eagle3", "plain"]) == [("kept", 2), ("kept", 5)]
    assert [e[2] for e in head.extended] == [[[float(p)] * 2 for p in r] for r in (range(2, 5), [5])]  # kept, own
    assert seqs[0].draft_cached == 6 and stats(seqs[0], 3).backlog is None and stats(seqs[1], 3).backlog.rows == 2
    seqs[1].draft_cached = 0  # a recompute of "long" from position 0
    assert step({"kept": 6, "long": 0}, {"kept": 1, "long": 3}, ["eagle3", "eagle3"]) == [("kept", 6), ("long", 0)]
    assert not stats(seqs[1], 3).head_gap and seqs[1].draft_cached == 3


def draft_kv_rows(engine, seq, upto: int) -> torch.Tensor:
    """The head's K and V at positions [0, upto) of `seq`, gathered through its block table."""
    k, v = engine.runner.draft_kv
    bs = k.shape[1]
    slots = torch.tensor([seq.table[p // bs] * bs + p % bs for p in range(upto)])
    return torch.cat([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]], dim=-1)


def test_the_heads_catch_up_holds_what_extending_every_step_holds(tiny_dirs, heads):
    """The same requests, once drafting a chain of 3 from the head every step, once with two stretches of
    plain steps between (the head extends over nothing then, and catches up when it drafts again): its
    cache over every position it covers is the same (to float tolerance: the catch-up extends over many
    rows in one pass), and it covers the requests to their last drafting step."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def run(off_at: set[int]):
        llm = adaptive_llm(tiny_dirs, heads["llama"])
        engine, policy = llm.engine, llm.engine.proposer.policy
        step_no = [0]

        def choose(stats_, found, remaining=None, queued=0):
            if step_no[0] in off_at:
                return Plan(Arm(0), ["plain"] * len(found))
            return Plan(Arm(3), ["eagle3"] * len(found))

        policy.choose = choose
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        for step_no[0] in range(30):
            engine.step()
        return engine, list(engine.scheduler.running)

    on_engine, on_seqs = run(set())
    off_engine, off_seqs = run(set(range(4, 10)) | set(range(14, 19)))
    assert [s.request_id for s in on_seqs] == [s.request_id for s in off_seqs] == [f"r{i}" for i in range(4)]
    for on, off in zip(on_seqs, off_seqs):
        n = min(len(on.tokens), len(off.tokens))
        assert on.tokens[:n] == off.tokens[:n]  # lossless: the same tokens, committed at other steps
        assert not off.spec_stats.head_gap and off.draft_cached >= off.num_cached - 4, (off.draft_cached, off.num_cached)
        upto = min(on.draft_cached, off.draft_cached)
        assert upto > len(off.tokens) // 2
        torch.testing.assert_close(draft_kv_rows(off_engine, off, upto), draft_kv_rows(on_engine, on, upto),
                                   atol=1e-5, rtol=1e-4)


def test_the_catch_up_is_timed_apart_from_the_plan():
    """The pass over rows kept while plain steps ran (50 ms here) is the deferred cost of those steps: the
    head's line learns the step's own extension and drafting only."""
    head = RecordingHead()
    head.catch_up_seconds = 0.05
    proposer = AdaptiveProposer(head, NoLookup(), 3)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=8), 0)
    learned = []
    real_update = proposer.policy.draft_cost.update
    proposer.policy.draft_cost.update = lambda x, y: (learned.append((x[1], y)), real_update(x, y))
    for start, source in ((0, "plain"), (1, "plain"), (2, "eagle3")):
        forced(proposer, [source])
        proposer.propose(Proposal([Committed(seq, start, [0], True)], torch.zeros(1, 2), decode_rows=1))
    assert seq.draft_cached == 3 and [rows for rows, _ in learned] == [1] and learned[0][1] < 0.04, learned
