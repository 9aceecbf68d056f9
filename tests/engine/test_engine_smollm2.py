"""The engine on the embedded SmolLM2-135M: HF logit parity and lossless speculation, for real."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.heads import random_head
from tsengine.eagle3.format import save_head
from tsengine.entrypoints.llm import LLM
from tsengine.infer.reference import compare_to_greedy, greedy_generate
from tsengine.model.context import Context
from tsengine.sampling_params import SamplingParams
from tsengine.targets import encode_prompt

pytestmark = pytest.mark.real_model
TEXTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
         "Give me three tips for sleeping better."]


@pytest.fixture(scope="module")
def engines(smollm2, tmp_path_factory):
    path, hf, tok = smollm2
    head = random_head(hf, seed=1, draft_vocab_size=2048)
    head_dir = save_head(head, tmp_path_factory.mktemp("smol-head"))
    kw = dict(debug_checks=True, max_model_len=512, max_num_batched_tokens=24)
    plain = LLM(str(path), **kw)
    spec = LLM(str(path), speculative_config={"method": "eagle3", "adaptive": False, "model": str(head_dir),
                                              "num_speculative_tokens": 3}, **kw)
    return hf, tok, plain, spec


def test_logits_match_hf(engines):
    hf, tok, plain, _ = engines
    ids = encode_prompt(tok, TEXTS[0])
    r = plain.engine.runner
    table = list(range(r.blocks.blocks_for(len(ids))))
    ctx = Context.build([(table, 0, len(ids))], r.block_size, "cpu")
    with torch.no_grad():
        ours = r.model.logits(r.model(torch.tensor(ids), ctx, r.kv)[0])
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)


def test_speculation_is_lossless_in_a_batch(engines):
    """Greedy: engine with and without a (random) head == HF full-recompute greedy (near-tie rule);
    seeded sampling at T = 0.7: identical with and without speculation."""
    hf, tok, plain, spec = engines
    prompts = [encode_prompt(tok, t) for t in TEXTS]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = plain.generate(prompts, greedy)
    b = spec.generate(prompts, greedy)
    for p, x, y in zip(prompts, a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        verdict = compare_to_greedy(hf, p, x.outputs[0].token_ids, greedy_generate(hf, p, 24))
        assert verdict.status in ("match", "near-tie"), str(verdict)
        if verdict.status == "near-tie":  # allowed by the rule, never silent: shows in pytest's warnings summary
            warnings.warn(f"engine vs HF greedy: {verdict}")
        assert y.spec_verify_steps > 0
    sampled = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    a = plain.generate(prompts, sampled)
    b = spec.generate(prompts[::-1], sampled[::-1])[::-1]
    assert [x.outputs[0].token_ids for x in a] == [y.outputs[0].token_ids for y in b]
