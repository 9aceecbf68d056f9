"""Adaptive speculation (tsengine/spec/adaptive.py, issue 15): lossless under any decisions, and a policy
that follows what it measures."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest

from tests.helpers import PROMPTS, make_llm
from tsengine.config import SpeculativeConfig
from tsengine.errors import UserError
from tsengine.llm import LLM
from tsengine.prometheus import PrometheusMetrics
from tsengine.sampling import SamplingParams
from tsengine.spec.adaptive import Acceptance, AdaptiveProposer, LinearCost

PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=4, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]


def adaptive_llm(tiny_dirs, head, **kw) -> LLM:
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    return LLM(str(tiny_dirs["llama"]), speculative_config={"method": "auto", "model": str(head),
                                                            "num_speculative_tokens": 3}, **kw)


@pytest.mark.parametrize("blocks", [None, 40], ids=["roomy", "preempting"])
def test_any_decisions_keep_plain_outputs(tiny_dirs, heads, blocks):
    """Random draft lengths forced through the test hook, mixed greedy/seeded batch, chunked prefill, and
    (40 blocks) preemption: every token is plain decoding's."""
    kw = {"num_kv_blocks": blocks, "max_model_len": 128} if blocks else {}
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs, **kw).generate(PROMPTS, PARAMS)]
    llm = adaptive_llm(tiny_dirs, heads["llama"], **kw)
    rng = random.Random(7)
    llm.engine.proposer.choose = lambda batch: rng.randrange(4)
    scheduler, preempted = llm.engine.scheduler, []
    real_preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq), real_preempt(seq))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == want
    proposer = llm.engine.proposer
    assert sum(1 for n in proposer.chosen if n) >= 3, proposer.chosen  # several lengths were really run
    stats = llm.engine.stats
    assert stats.num_drafts > 0 and stats.drafted_per_pos[0] > stats.drafted_per_pos[2] > 0
    assert bool(preempted) == bool(blocks), len(preempted)


def test_the_policy_runs_unforced_and_stays_lossless(tiny_dirs, heads):
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs).generate(PROMPTS * 2, PARAMS * 2)]
    llm = adaptive_llm(tiny_dirs, heads["llama"])
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, PARAMS * 2)] == want
    p = llm.engine.proposer
    assert p.target_cost.samples > 10 and p.draft_cost.samples > 10
    text = generate_latest(PrometheusMetrics(llm.engine).registry).decode()
    for family in ("spec_decode_draft_length", "spec_decode_acceptance_estimate",
                   "spec_decode_cost_model_seconds", "spec_decode_num_drafted_tokens_per_pos_total"):
        assert f"tsengine:{family}" in text, family


def test_linear_cost_recovers_a_line():
    model = LinearCost(2, forget=1.0)
    for rows in range(1, 60):
        model.update([1.0, rows], 0.01 + 0.002 * rows)
    assert model.theta.tolist() == pytest.approx([0.01, 0.002], rel=1e-3)
    assert model.predict([1.0, 100]) == pytest.approx(0.21, rel=1e-3)


def test_acceptance_counts_the_accepted_run():
    a = Acceptance(3, prior=0)
    a.observe(3, 1)  # drafted 3, accepted 1: position 0 hit, 1 and 2 missed
    a.observe(2, 2)
    assert a.rates() == [1.0, 0.5, 0.0] and a.tokens(2) == 2.5


class _Fake:
    def __init__(self):
        self.steps = 3


def trained_policy(draft_step_seconds: float) -> AdaptiveProposer:
    """A policy whose models were fed: target 10 ms + 0.1 ms per row; drafting `draft_step_seconds` per step;
    every draft accepted."""
    p = AdaptiveProposer(_Fake(), 3)
    p.decisions = 100  # past warm-up
    for rows in range(1, 80):
        p.target_cost.update([1.0, rows, 0.0], 0.010 + 0.0001 * rows)
        p.target_cost.update([1.0, 1, rows * 4], 0.010 + 0.0001 + 0.00001 * rows * 4)
    for batch in (1, 2, 4, 8):
        for k in range(4):
            p.draft_cost.update([1.0, batch, k, k * batch], 0.001 + draft_step_seconds * k)
    for _ in range(200):
        p.acceptance.observe(3, 3)
    return p


def test_the_policy_speculates_when_it_pays_and_not_when_it_does_not():
    assert trained_policy(draft_step_seconds=0.0005).choose(4) == 3  # cheap, always accepted
    assert trained_policy(draft_step_seconds=0.05).choose(4) == 0  # drafting costs 5 target steps
    never = AdaptiveProposer(_Fake(), 3)
    never.decisions = 100
    for rows in range(1, 80):
        never.target_cost.update([1.0, rows, 0.0], 0.010 + 0.0001 * rows)
    for _ in range(500):
        never.acceptance.observe(3, 0)
    assert never.choose(4) == 0  # nothing is ever accepted


def test_config_forms():
    auto = SpeculativeConfig.resolve(config_json={"method": "auto", "model": "HEAD", "num_speculative_tokens": 4})
    assert auto.algorithm == "EAGLE3" and auto.adaptive and auto.num_steps == 4
    flag = SpeculativeConfig.resolve(algorithm="EAGLE3", draft_model_path="HEAD", adaptive=True)
    assert flag.adaptive
    with pytest.raises(UserError, match="adaptive speculation chooses among EAGLE3 chain lengths"):
        SpeculativeConfig.resolve(algorithm="EAGLE3", draft_model_path="HEAD", adaptive=True, eagle_topk=2,
                                  num_draft_tokens=4)
    with pytest.raises(UserError, match="adaptive speculation"):
        SpeculativeConfig.resolve(algorithm="NGRAM", adaptive=True)
