"""Adaptive speculation in the engine (tsengine/speculative/adaptive/policy.py, adaptive_proposer.py, issue 15):
lossless under any decisions (plain, chains, trees, prompt lookup, pads, per-request sources), the server and the
config, and the head's lazy extension. The policy's own choices: tests/speculative/test_adaptive_policy.py."""

from __future__ import annotations

import random
import time

import pytest
import torch
from prometheus_client import generate_latest

from tests.helpers.engine import PROMPTS, make_llm
from tests.helpers.server import serving
from tsengine.config import EngineConfig, SpeculativeConfig
from tsengine.entrypoints.llm import LLM
from tsengine.entrypoints.openai.prometheus import PrometheusMetrics
from tsengine.errors import UserError
from tsengine.sampling_params import SamplingParams
from tsengine.sequence import Sequence
from tsengine.speculative.adaptive.estimates import stats
from tsengine.speculative.adaptive.plan import PAD, Arm, Plan
from tsengine.speculative.adaptive.policy import AdaptivePolicy
from tsengine.speculative.adaptive.proposer import AdaptiveProposer
from tsengine.speculative.drafts import Committed, Proposal

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

    def choose(stats, found, remaining=None, queued=0, kept=None):
        arm = rng.choice(policy.arms)
        if arm.is_tree or not arm.steps:
            return Plan(arm, ["eagle3" if arm.steps else "plain"] * len(found))
        return Plan(arm, [rng.choice(["eagle3", "plain", PAD] + (["ngram"] if f else [])) for f in found])

    return choose


@pytest.mark.parametrize("blocks", [None, 40], ids=["roomy", "preempting"])
def test_any_decisions_keep_plain_outputs(tiny_dirs, heads, blocks):
    """Random plans forced through the test hook (plain, chains 1..3, a 3x2x6 tree; per request the head,
    prompt lookup, its last token repeated or nothing), a mixed greedy/seeded batch, chunked prefill and (40 blocks)
    preemption: every token is plain decoding's."""
    kw = {"num_kv_blocks": blocks, "max_model_len": 128} if blocks else {}
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs, **kw).generate(PROMPTS, PARAMS)]
    llm = adaptive_llm(tiny_dirs, heads["llama"], tree=True, **kw)
    policy = llm.engine.proposer.policy
    policy.choose = random_plans(policy, random.Random(7))
    proposer = llm.engine.proposer
    caught, real_catch_up = [0], proposer._catch_up

    def catch_up(runs):  # counts the runs the head extends over with rows kept since it last drafted
        caught[0] += sum(c.seq.head_backlog.rows > 0 for c in runs)
        return real_catch_up(runs)

    proposer._catch_up = catch_up
    scheduler, preempted = llm.engine.scheduler, []
    real_preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq), real_preempt(seq))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == want
    assert {"plain", "chain 1", "chain 3", "tree 3x2x6"} <= set(policy.chosen), policy.chosen
    assert caught[0] > 1, caught
    assert (policy.drafted_by["ngram"] > 0 and policy.drafted_by["eagle3"] > 0
            and policy.drafted_by[PAD] > 0), policy.drafted_by
    stats = llm.engine.stats
    assert stats.num_drafts > 0 and stats.drafted_per_pos[0] > stats.drafted_per_pos[2] > 0, (
        stats.num_drafts, stats.drafted_per_pos, policy.drafted_by, caught)
    assert bool(preempted) == bool(blocks), len(preempted)


def test_the_policy_runs_unforced_and_stays_lossless(tiny_dirs, heads):
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs).generate(PROMPTS * 2, PARAMS * 2)]
    llm = adaptive_llm(tiny_dirs, heads["llama"], tree=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, PARAMS * 2)] == want
    p = llm.engine.proposer.policy
    assert p.costs.target.samples > 10 and p.costs.draft.samples > 0  # the head learns from its drafting steps only
    assert sum(p.chosen.values()) == p.decisions
    text = generate_latest(PrometheusMetrics(llm.engine).registry).decode()
    for family in ("spec_decode_draft_length", "spec_decode_acceptance_estimate{position=\"0\",source=\"ngram\"}",
                   "spec_decode_tree_tokens_estimate{shape=\"3x2x6\"}", "spec_decode_cost_model_seconds",
                   "spec_decode_policy_steps_total", "spec_decode_policy_requests_total",
                   "spec_decode_prediction_ratio", "spec_decode_num_drafted_tokens_per_pos_total",
                   "spec_decode_step_seconds", "spec_decode_head_seconds",
                   "spec_decode_refill_share"):
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


def test_adaptive_is_the_default_for_a_head_unless_pinned():
    """Issue 43: a configured head is adaptive unless the user pins the shape (`adaptive` false, or
    --no-speculative-adaptive) or verifies by a rule whose tokens depend on the drafts; prompt lookup alone
    stays fixed."""
    import argparse

    from tsengine.entrypoints.engine_args import add_engine_args, engine_config

    assert SpeculativeConfig.resolve(algorithm="EAGLE3", draft_model_path="HEAD", num_steps=3).adaptive is True
    assert SpeculativeConfig.resolve(config_json={"method": "eagle3", "model": "HEAD",
                                                  "num_speculative_tokens": 3}).adaptive is True
    assert SpeculativeConfig.resolve(config_json={"method": "eagle3", "model": "HEAD", "adaptive": False}).adaptive \
        is False
    assert SpeculativeConfig.resolve(algorithm="NGRAM").adaptive is False
    assert SpeculativeConfig.resolve(adaptive=False) is None  # pinning alone asks for no speculation
    # the rejection and multiround rules' seeded tokens depend on the drafts, which a policy choosing by measured
    # time would vary run to run: fixed by default there, adaptive only when asked
    for rule in ({"speculative_sampling": True}, {"tree_sampling": "multiround"}):
        base = {"method": "eagle3", "model": "HEAD", **rule}
        assert SpeculativeConfig.resolve(config_json=base).adaptive is False
        assert SpeculativeConfig.resolve(config_json={**base, "adaptive": True}).adaptive is True
    p = argparse.ArgumentParser()
    add_engine_args(p)
    head = ["--model", "M", "--speculative-algorithm", "eagle3", "--speculative-draft-model-path", "HEAD"]
    assert engine_config(p.parse_args(head)).speculative.adaptive is True
    assert engine_config(p.parse_args([*head, "--no-speculative-adaptive"])).speculative.adaptive is False


def test_the_default_engine_with_a_head_runs_the_adaptive_proposer(tiny_dirs, heads):
    llm = LLM(str(tiny_dirs["llama"]), speculative_config={"method": "eagle3", "model": str(heads["llama"]),
                                                           "num_speculative_tokens": 3})
    assert isinstance(llm.engine.proposer, AdaptiveProposer)
    pinned = LLM(str(tiny_dirs["llama"]), speculative_config={"method": "eagle3", "model": str(heads["llama"]),
                                                              "num_speculative_tokens": 3, "adaptive": False})
    assert not isinstance(pinned.engine.proposer, AdaptiveProposer)


class RecordingHead:
    """Stands for the EAGLE-3 proposer: records the runs (and their features) it was asked to extend over."""

    extended: list = []
    catch_up_seconds = 0.0  # how long a pass over kept rows only (no run drafts next) takes
    drafted_in_graph = None  # it has no graphs

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
    proposer.policy.choose = lambda st, found, remaining=None, queued=0, kept=None: Plan(Arm(steps), list(sources))


def test_the_head_extends_only_over_requests_it_can_draft_for():
    """A request with a hole in the head's cache (`head_gap`) never drafts from it again (until a
    recompute): the head's extension is not spent on that request's rows."""
    head = RecordingHead()
    proposer = AdaptiveProposer(head, NoLookup(), steps=3)
    forced(proposer, ["eagle3", "eagle3"])
    skipped, fresh = (Sequence(r, [1] * 10, SamplingParams(max_tokens=8), 0) for r in ("skipped", "fresh"))
    skipped.num_cached, skipped.draft_cached = 9, 4
    stats(skipped, 3).head_gap = True
    runs = [Committed(seq=skipped, start=8, rows=[0], drafts_next=True),
            Committed(seq=fresh, start=0, rows=list(range(1, 10)), drafts_next=True)]
    proposer.propose(Proposal(runs=runs, aux=torch.zeros(10, 2), decode_rows=1, prefill_rows=9))
    assert [r for r, _, _ in head.extended] == ["fresh"]


def test_the_head_extends_over_a_request_when_it_drafts_for_it_and_keeps_its_features_until_then(monkeypatch):
    """A step that does not draft for a request from the head (plain, prompt lookup, the head off) keeps
    the run's target features; the step that does extends over the kept rows and its own in one run from
    where the head's cache ends, with those very features. Past `BACKLOG_ROWS` kept rows it catches up
    without drafting; a run from where the head's cache ends starts afresh."""
    import tsengine.speculative.adaptive.proposer as module

    monkeypatch.setattr(module, "BACKLOG_ROWS", 6)
    head = RecordingHead()
    proposer = AdaptiveProposer(head, NoLookup(), steps=3)
    seqs = [Sequence(r, list(range(20)), SamplingParams(max_tokens=8), 0) for r in ("kept", "long")]

    def step(start: dict[str, int], rows_of: dict[str, int], sources: list[str]):
        forced(proposer, sources)
        head.extended = []
        runs, aux = [], []  # every run's features: its position, as a row of 2 values
        for seq in seqs:
            n = rows_of[seq.request_id]
            runs.append(Committed(seq=seq, start=start[seq.request_id], rows=list(range(len(aux), len(aux) + n)),
                                  drafts_next=True))
            aux += [[float(start[seq.request_id] + i)] * 2 for i in range(n)]
        proposer.propose(Proposal(runs=runs, aux=torch.tensor(aux), decode_rows=2))
        return [(r, s) for r, s, _ in head.extended]

    assert step({"kept": 0, "long": 0}, {"kept": 2, "long": 2}, ["eagle3", "plain"]) == [("kept", 0)]
    assert step({"kept": 2, "long": 2}, {"kept": 1, "long": 4}, ["plain", "ngram"]) == []
    assert seqs[1].head_backlog.rows == 6
    assert step({"kept": 3, "long": 6}, {"kept": 1, "long": 4}, ["plain", "plain"]) == [("long", 0), ("long", 6)]
    assert [e[2] for e in head.extended] == [[[float(p)] * 2 for p in r] for r in (range(6), range(6, 10))]
    assert seqs[1].draft_cached == 10  # 10 kept rows > 6: caught up (the kept ones first), without drafting
    assert step({"kept": 4, "long": 10}, {"kept": 1, "long": 1}, ["plain", "plain"]) == []
    assert step({"kept": 5, "long": 11}, {"kept": 1, "long": 1}, ["eagle3", "plain"]) == [("kept", 2), ("kept", 5)]
    assert [e[2] for e in head.extended] == [[[float(p)] * 2 for p in r] for r in (range(2, 5), [5])]  # kept, own
    assert seqs[0].draft_cached == 6 and seqs[0].head_backlog is None and seqs[1].head_backlog.rows == 2
    seqs[1].draft_cached = 0  # a recompute of "long" from position 0
    assert step({"kept": 6, "long": 0}, {"kept": 1, "long": 3}, ["eagle3", "eagle3"]) == [("kept", 6), ("long", 0)]
    assert not stats(seqs[1], 3).head_gap and seqs[1].draft_cached == 3


def test_requests_the_head_never_drafts_for_are_prefix_cached_as_in_a_plain_engine(tiny_dirs, heads):
    """With the policy choosing plain decoding every step, the head never drafts: it still extends over
    prompts and over finished requests, so their blocks are keyed as a plain engine keys them. A shared
    system prompt, then the next turn of each conversation, hit as many positions as in a plain engine,
    with the same outputs. (Kept for a head that never came, the blocks were never keyed: no hits.)"""
    system = list(range(100, 123))  # 5 full blocks of 4 and a partial one
    first = [system + [5, 6, 7], system + [8, 9], [7, 8, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(llm):
        outs = [o.outputs[0].token_ids for o in llm.generate(first, greedy)]
        second = [p + out + [11, 12] for p, out in zip(first, outs)]
        outs += [o.outputs[0].token_ids for o in llm.generate(second, greedy)]
        return outs, llm.engine.scheduler.prefix.hits

    adaptive = adaptive_llm(tiny_dirs, heads["llama"])
    adaptive.engine.proposer.policy.choose = lambda st, *_a, **_k: Plan(Arm(0), ["plain"] * len(st))
    want, hits = run(make_llm(tiny_dirs))
    got, got_hits = run(adaptive)
    assert got == want
    assert hits >= 20 + 3 * 12 and got_hits == hits, (got_hits, hits)  # the system prompt, and every first turn


def test_a_finished_requests_head_rows_wait_for_a_next_turn_that_drafts(tiny_dirs, heads):
    """With the policy choosing plain decoding, a finishing request costs no head pass: its blocks are keyed
    with the head's rows pending (tsengine/cache/prefix_cache.py `Pending`). Its next turn hits them as a
    plain engine would, and drafting from the head there catches up over the kept features: the head's
    cache over the first turn's blocks is then what an engine whose head drafted every step holds, and the
    outputs are plain decoding's. (Caught up at finish, the previous version made a pass per request.)"""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = [PROMPTS[0], PROMPTS[1]]

    def run(first_arm: Arm):
        llm = adaptive_llm(tiny_dirs, heads["llama"])
        engine, proposer = llm.engine, llm.engine.proposer
        passes, real_catch_up = [], proposer._catch_up
        proposer._catch_up = lambda runs: (passes.append(sum(c.seq.head_backlog.rows for c in runs)),
                                           real_catch_up(runs))[1]
        proposer.policy.choose = lambda st, *_a, **_k: Plan(first_arm, ["eagle3" if first_arm.steps else "plain"]
                                                            * len(st))
        outs = [o.outputs[0].token_ids for o in llm.generate(first, greedy)]
        at_finish, kept = list(passes), dict(engine.scheduler.prefix.pending)
        pending = sum(len(p.features) for p in kept.values())  # rows kept with the first turns' blocks
        proposer.policy.choose = lambda st, *_a, **_k: Plan(Arm(3), ["eagle3"] * len(st))
        second = [p + out + [11, 12] for p, out in zip(first, outs)]
        outs += [o.outputs[0].token_ids for o in llm.generate(second, greedy)]
        prefix = engine.scheduler.prefix
        turns = [Sequence("x", p, greedy, 0) for p in second]
        for seq in turns:
            seq.table = prefix.lookup(seq)
        return outs, at_finish, pending, passes[len(at_finish):], prefix, engine, turns, kept

    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs).generate(
        first + [p + out + [11, 12] for p, out in zip(first, [o.outputs[0].token_ids for o in
                                                             make_llm(tiny_dirs).generate(first, greedy)])], greedy)]
    outs, at_finish, pending, later, prefix, engine, turns, kept = run(Arm(0))
    ref_outs, _, ref_pending, _, ref_prefix, ref_engine, ref_turns, _ = run(Arm(3))
    assert outs == ref_outs == want
    assert not any(at_finish) and pending > 0 and ref_pending == 0, (at_finish, pending, ref_pending)
    assert sum(later) >= pending  # the next turns caught up over the kept rows (and their own) once drafting
    assert not set(kept) & set(prefix.pending) and prefix.hits == ref_prefix.hits  # covered since: complete
    for seq, ref in zip(turns, ref_turns):
        upto = 4 * min(len(seq.table), len(ref.table))
        assert upto >= len(seq.tokens) // 2
        torch.testing.assert_close(draft_kv_rows(engine, seq, upto), draft_kv_rows(ref_engine, ref, upto),
                                   atol=5e-5, rtol=1e-4)


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

        def choose(stats_, found, remaining=None, queued=0, kept=None):
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
        assert not off.spec_stats.head_gap and off.draft_cached >= off.num_cached - 4, (off.draft_cached,
                                                                                         off.num_cached)
        upto = min(on.draft_cached, off.draft_cached)
        assert upto > len(off.tokens) // 2
        # the same rows computed in other batch shapes: fp32 summation order differs by kernel (1.1e-5 seen on
        # an AVX-512 Xeon); a wrong or missing row is off by orders of magnitude more
        torch.testing.assert_close(draft_kv_rows(off_engine, off, upto), draft_kv_rows(on_engine, on, upto),
                                   atol=5e-5, rtol=1e-4)


def test_the_catch_up_is_timed_apart_from_the_plan():
    """The pass over rows kept while plain steps ran (50 ms here) is the deferred cost of those steps: the
    head's line learns the step's own extension and drafting only."""
    head = RecordingHead()
    head.catch_up_seconds = 0.05
    proposer = AdaptiveProposer(head, NoLookup(), steps=3)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=8), 0)
    learned = []
    real_update = proposer.policy.costs.draft.update
    proposer.policy.costs.draft.update = lambda x, y: (learned.append((x[1], y)), real_update(x, y))
    for start, source in ((0, "plain"), (1, "plain"), (2, "eagle3")):
        forced(proposer, [source])
        proposer.propose(Proposal(runs=[Committed(seq=seq, start=start, rows=[0], drafts_next=True)],
                                  aux=torch.zeros(1, 2), decode_rows=1))
    assert seq.draft_cached == 3 and [rows for rows, _ in learned] == [1] and learned[0][1] < 0.04, learned


@pytest.mark.parametrize("compiling", [False, True])
def test_a_catch_up_timed_across_a_compile_teaches_its_line_nothing(monkeypatch, compiling):
    """A compile shares the cores: a pass of a few rows timed across one took 40-50 ms against 1.5-3, and a
    few such samples swung the catch-up line to 25 ms a row (in-process, 4 requests)."""
    from tsengine.model import compile_worker

    if compiling:
        monkeypatch.setattr(compile_worker, "quiet", lambda start_epoch: False)
    proposer = AdaptiveProposer(RecordingHead(), NoLookup(), steps=3)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=8), 0)
    for start, source in ((0, "plain"), (1, "plain"), (2, "eagle3")):
        forced(proposer, [source])
        proposer.propose(Proposal(runs=[Committed(seq=seq, start=start, rows=[0], drafts_next=True)],
                                  aux=torch.zeros(1, 2), decode_rows=1))
    assert seq.draft_cached == 3  # caught up either way
    assert proposer.policy.costs.catch_up.samples == (0 if compiling else 1)
