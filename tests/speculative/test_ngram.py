"""NGRAM drafting (prompt lookup): the lookup rule, and the engine staying lossless with it."""

from __future__ import annotations

import random

import pytest

from tests.helpers.engine import PROMPTS, greedy_truth
from tsengine.entrypoints.llm import LLM
from tsengine.errors import UserError
from tsengine.sampling_params import SamplingParams
from tsengine.speculative.ngram import NgramIndex, propose


def test_propose_longest_then_latest_match():
    # "5 2 3" never occurred; "2 3" did, latest at 5
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, 1, 3) == [7, 5, 2]
    assert propose([4, 1, 2, 8, 1, 2], 2, 1, 4) == [8, 1]
    assert propose([5, 6, 7], 3, 1, 3) is None  # nothing repeats
    assert propose([1, 2, 1], 4, 1, 2) == [2, 1]  # a short continuation is still a proposal
    assert propose([3, 3, 3, 3], 2, 2, 2) == [3]  # the latest match wins even with a shorter continuation


def test_the_index_answers_as_the_search_does():
    """NgramIndex (a dict updated as tokens arrive) against `propose` (the search): every prefix of random
    token lists over small alphabets, so matches, overlaps and ties are common."""
    rng = random.Random(0)
    for trial in range(60):
        tokens = [rng.randrange(2 + trial % 5) for _ in range(rng.randrange(1, 60))]
        n_min = rng.randrange(1, 3)
        n_max = n_min + rng.randrange(0, 3)
        index = NgramIndex(n_min, n_max)
        for end in range(1, len(tokens) + 1):
            if rng.random() < 0.5:  # the index catches up over several appended tokens too
                assert index.lookup(tokens[:end], 3) == propose(tokens[:end], 3, n_min, n_max), (tokens[:end], n_min,
                                                                                                  n_max)


def ngram_llm(tiny_dirs, kind="llama", steps=3, topk=None, **kw):
    spec = {"method": "ngram", "num_speculative_tokens": steps, "prompt_lookup_max": 3}
    if topk:
        spec.update(eagle_topk=topk, num_draft_tokens=8)
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    return LLM(str(tiny_dirs[kind]), speculative_config=spec, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_ngram_greedy_equals_greedy_mixed_batch(tiny_dirs, kind):
    """The prompts repeat n-grams, so requests verify NGRAM drafts; the output equals plain greedy token for
    token, and seeded sampling too. (A random tiny model rarely repeats itself, so acceptance is measured
    on SmolLM2 in bench/engine_speed.py, not asserted here.)"""
    truth = greedy_truth(tiny_dirs, kind, 40)
    llm = ngram_llm(tiny_dirs, kind)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [truth[tuple(p)] for p in PROMPTS]
    assert llm.engine.stats.num_drafts > 0
    sp = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=3)
    plain = LLM(str(tiny_dirs[kind]), block_size=4).generate(PROMPTS, sp)
    spec = ngram_llm(tiny_dirs, kind).generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_ngram_settings_errors(tiny_dirs):
    with pytest.raises(UserError, match="drafter NGRAM: drafts a chain"):
        ngram_llm(tiny_dirs, topk=2)
    with pytest.raises(UserError, match="NGRAM uses no draft model"):
        LLM(str(tiny_dirs["llama"]), speculative_config={"method": "ngram", "model": "/x"})
    with pytest.raises(UserError, match="prompt_lookup_min 4 > prompt_lookup_max 2"):
        LLM(str(tiny_dirs["llama"]), speculative_config={"method": "ngram", "prompt_lookup_min": 4,
                                                          "prompt_lookup_max": 2})
