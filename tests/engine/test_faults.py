"""Per-request fault isolation in the engine (tsengine/engine/faults.py, issue 14).

A request whose data makes a step fail stops alone with finish_reason "error"; every other request gets
exactly the tokens of a run without it. Engine-wide failures (out of memory) still stop everything.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.engine import PROMPTS, make_llm
from tsengine.engine.faults import EngineFault
from tsengine.errors import UserError
from tsengine.sample.verify import NON_FINITE
from tsengine.sampling_params import SamplingParams

OTHERS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
POISON = SamplingParams(temperature=0.5, seed=666, max_tokens=12, ignore_eos=True)


def run(llm, with_poison: bool, poison=None) -> tuple[dict, dict]:
    """Drive the engine by hand: PROMPTS with OTHERS, plus (optionally) a poisoned request added second,
    poisoned by `poison(engine)` once admitted. Returns tokens and finish outputs by request id."""
    engine = llm.engine
    for i, (prompt, sp) in enumerate(zip(PROMPTS, OTHERS)):
        engine.add_request(f"r{i}", prompt, sp)
        if i == 0 and with_poison:
            engine.add_request("poison", [11, 12, 13, 14], dataclasses.replace(POISON))
            if poison is not None:
                poison(engine)
    tokens, finished = {}, {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished()
    blocks = engine.runner.blocks
    assert blocks.num_free == blocks.num_blocks, "a failed request leaked blocks"
    return tokens, finished


def slip_past_validation(engine):
    engine.requests["poison"].params.top_k = 2**63  # as if validation had missed it: the step overflows


@pytest.fixture(params=["plain", "eagle3"])
def llm_factory(request, tiny_dirs, heads):
    head = heads["llama"] if request.param == "eagle3" else None
    return lambda: make_llm(tiny_dirs, head=head)


def test_bad_parameters_that_slipped_through_stop_only_their_request(llm_factory):
    want, _ = run(llm_factory(), with_poison=False)
    got, finished = run(llm_factory(), with_poison=True, poison=slip_past_validation)
    assert finished["poison"].finish_reason == "error" and "ValueError" in finished["poison"].error
    assert "poison" not in got or got["poison"] == []
    assert {k: v for k, v in got.items() if k != "poison"} == want  # bit-identical tokens for everyone else
    assert all(finished[f"r{i}"].finish_reason == "length" for i in range(len(PROMPTS)))


@pytest.mark.parametrize("poison", ["nan rows", "one +inf", "one -inf"])
def test_non_finite_logits_for_one_request_stop_it_alone(llm_factory, poison):
    """The guard: non-finite logits never reach argmax or sampling; the request whose rows have them stops
    (whole rows of NaN, or one infinite logit in its first row)."""
    want, _ = run(llm_factory(), with_poison=False)
    llm = llm_factory()
    runner, real = llm.engine.runner, llm.engine.runner.run
    calls = []

    def nan_for_poison(batch):
        forward = real(batch)
        row = 0
        for s in batch:
            rows = s.num_tokens if s.verify else int(s.samples)
            if s.seq.request_id == "poison" and rows and s.seq.num_output >= 2:
                if poison == "nan rows":
                    forward.logits[row:row + rows] = float("nan")
                else:
                    forward.logits[row, 7] = float(poison.split()[1])
                calls.append(s.verify)
            row += rows
        return forward

    runner.run = nan_for_poison
    got, finished = run(llm, with_poison=True)
    assert calls, "the poisoned request never reached the injected step"
    assert (finished["poison"].finish_reason, finished["poison"].error) == ("error", NON_FINITE)
    assert len(got["poison"]) == 2  # what it had before its logits went bad
    assert {k: v for k, v in got.items() if k != "poison"} == want


def test_a_drafting_failure_is_isolated_too(tiny_dirs, heads):
    want, _ = run(make_llm(tiny_dirs, head=heads["llama"]), with_poison=False)
    llm = make_llm(tiny_dirs, head=heads["llama"])
    proposer = llm.engine.proposer
    real = proposer.propose

    def propose(proposal):
        if any(c.seq.request_id == "poison" and c.seq.num_output >= 3 for c in proposal.runs):
            raise IndexError("injected drafting failure")
        return real(proposal)

    proposer.propose = propose
    got, finished = run(llm, with_poison=True)
    assert finished["poison"].finish_reason == "error" and "IndexError" in finished["poison"].error
    assert {k: v for k, v in got.items() if k != "poison"} == want


def test_engine_wide_failure_stops_everything_and_says_so(tiny_dirs):
    llm = make_llm(tiny_dirs)
    llm.engine.add_request("a", PROMPTS[0], OTHERS[0])

    def out_of_memory(batch):
        raise torch.OutOfMemoryError("injected")

    llm.engine.runner.run = out_of_memory
    with pytest.raises(EngineFault, match="engine-wide"):
        llm.engine.step()


def test_parameters_the_step_cannot_hold_are_refused_at_admission(tiny_dirs):
    with pytest.raises(UserError, match="top_k"):
        SamplingParams(temperature=0.5, top_k=2**63)
    with pytest.raises(UserError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**40])


def test_denormal_temperature_is_greedy(tiny_dirs):
    """logits / 1e-40 overflows float32 (inf, then NaN); below 1e-5 a temperature means greedy."""
    llm = make_llm(tiny_dirs)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tiny = [SamplingParams(temperature=t, max_tokens=10, ignore_eos=True, seed=1) for t in (1e-40, 1e-30, 9e-6)]
    assert all(sp.temperature == 0 for sp in tiny)
    outs = llm.generate([PROMPTS[0]] * 4, [greedy, *tiny])
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
