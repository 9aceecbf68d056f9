"""The int8 draft head (--speculative-draft-model-quantization int8): the engine drafts exactly what the
dequantized head drafts in the reference generator, outputs stay the target's, and where it cannot run
it is refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import PROMPTS, first_drafts, make_llm
from tsengine.errors import UserError
from tsengine.infer.reference import ReferenceSpeculator, SpecShape
from tsengine.kernels import rows_linear
from tsengine.linear import round_to_int8
from tsengine.llm import LLM
from tsengine.sampling import SamplingParams

needs_kernel = pytest.mark.skipif(not rows_linear.available(), reason="needs g++ and an AVX2/FMA CPU")


def _int8_spec(head, steps=3, **extra):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": steps, "quantization": "int8", **extra}


def _coarse_head(heads, hf, out_dir):
    """The tiny head with one outlier column in every weight: int8 then rounds the rest coarsely, so the
    int8 head drafts other tokens than the fp32 one (a test that the engine ran the int8 model can fail)."""
    from tsengine.eagle3.format import load_head, save_head

    head = load_head(heads["llama"], target=hf.config, embeddings=hf.get_input_embeddings().weight)
    with torch.no_grad():
        for lin in head.modules():
            if isinstance(lin, torch.nn.Linear):
                lin.weight[:, 0] = 20 * lin.weight.abs().amax()
    save_head(head, out_dir)
    return head


@needs_kernel
def test_engine_drafts_equal_the_reference_drafter_on_the_dequantized_head(tiny_dirs, tiny_models, heads, tmp_path):
    import copy

    hf, _ = tiny_models["llama"]
    head = _coarse_head(heads, hf, tmp_path)
    fp32 = ReferenceSpeculator(hf, head, SpecShape(3, 1, 4))
    ref = ReferenceSpeculator(hf, round_to_int8(copy.deepcopy(head)), SpecShape(3, 1, 4))
    prompt = PROMPTS[2]
    for budget in (64, 7):  # the prompt extended in one pass (dequantized fp32) and in few-row chunks (int8)
        llm = LLM(str(tiny_dirs["llama"]), speculative_config=_int8_spec(tmp_path), debug_checks=True,
                  block_size=4, max_num_batched_tokens=budget)
        tokens, drafts = first_drafts(llm, prompt)
        with torch.no_grad():
            feats = ref._target(tokens[:-1])[1]
            want = ref.draft(tokens, feats).tokens
            assert want != fp32.draft(tokens, feats).tokens, "int8 must change this head's drafts"
        assert drafts == want, f"chunk budget {budget}"


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)])
def test_outputs_with_the_int8_head_are_the_targets(tiny_dirs, tiny_models, heads, shape, tmp_path):
    """With the coarse head, whose int8 drafts differ from its fp32 ones (the first test)."""
    _coarse_head(heads, tiny_models["llama"][0], tmp_path)
    s, k, n = shape
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=11)]
    prompts = PROMPTS[:2]
    plain = make_llm(tiny_dirs).generate(prompts, params)
    llm = LLM(str(tiny_dirs["llama"]), debug_checks=True, block_size=4, max_num_batched_tokens=16,
              speculative_config=_int8_spec(tmp_path, s, eagle_topk=k, num_draft_tokens=n))
    head = llm.engine.runner.head
    stacked = {id(m) for lins in head.midlayer.fusable().values() for m in lins}  # served by `fused`
    alone = [m for m in head.modules() if isinstance(m, torch.nn.Linear) and id(m) not in stacked]
    served = [m.forward for m in alone] + list(head.midlayer.fused.values())
    assert alone and all(f.qweight is not None for f in served), "the head must be served in int8"
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats.num_drafts > 0


def test_without_the_kernel_int8_is_refused_by_name(tiny_dirs, heads, monkeypatch):
    """No AVX2, no g++ or TSENGINE_ROWS_LINEAR=0: int8 would run at fp32 speed and draft worse."""
    monkeypatch.setattr(rows_linear, "available", lambda: False)
    with pytest.raises(UserError, match=re.escape("speculative_draft_model_quantization int8: the few-row kernel is "
                                                  "unavailable")):
        LLM(str(tiny_dirs["llama"]), speculative_config=_int8_spec(heads["llama"]))


@pytest.mark.parametrize("kw, msg", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "quantization": "int8"}},
     "speculative_draft_model_quantization int8 quantizes an EAGLE3 head; NGRAM has none"),
    ({"speculative_config": {"method": "eagle3", "model": "x", "quantization": "int4"}},
     "draft_model_quantization"),
    ({"dtype": "bfloat16"}, "speculative_draft_model_quantization int8: the CPU float32 head's format"),
])
def test_where_int8_cannot_run_it_is_refused_by_name(tiny_dirs, heads, kw, msg):
    kw = {"speculative_config": _int8_spec(heads["llama"]), **kw}
    with pytest.raises(UserError, match=re.escape(msg)):
        LLM(str(tiny_dirs["llama"]), **kw)


def test_the_flag_alone_does_not_ask_for_speculation():
    from tsengine.config import SpeculativeConfig

    assert SpeculativeConfig.resolve(draft_model_quantization="none") is None
    with pytest.raises(UserError, match="draft_model_quantization set without speculative decoding"):
        SpeculativeConfig.resolve(draft_model_quantization="int8")


def _recorded_drafts(llm, prompts) -> list:
    """Every draft the engine's proposer makes while generating `prompts` greedily."""
    proposer, seen = llm.engine.proposer, []
    inner = proposer.propose

    def propose(*a, **kw):
        out = inner(*a, **kw)
        seen.extend(d.tokens.tolist() for d in out if d is not None)
        return out

    proposer.propose = propose
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return seen


@needs_kernel
def test_compiled_int8_and_fp32_heads_each_draft_their_own_eager_drafts(tiny_dirs, tiny_models, heads, tmp_path,
                                                                         monkeypatch):
    """Two compiled engines in one process, the same head file in fp32 and in int8: each one's drafts
    equal its eager twin's, and the two differ (the graphs call each head's own kernel and weights)."""
    monkeypatch.setenv("TSENGINE_ENFORCE_EAGER", "0")
    _coarse_head(heads, tiny_models["llama"][0], tmp_path)

    def llm(quant, eager):
        return LLM(str(tiny_dirs["llama"]), enforce_eager=eager, debug_checks=True, block_size=4,
                   max_num_batched_tokens=16, speculative_config=_int8_spec(tmp_path, quantization=quant))

    prompts = PROMPTS[:2]
    fp32, int8 = llm("none", False), llm("int8", False)
    got = {"none": _recorded_drafts(fp32, prompts), "int8": _recorded_drafts(int8, prompts)}
    assert got["int8"] == _recorded_drafts(llm("int8", True), prompts)
    assert got["none"] == _recorded_drafts(llm("none", True), prompts)
    assert got["int8"] != got["none"]
    assert int8.engine.proposer.graphs.graphs, "the int8 head's chain never ran through a graph"
