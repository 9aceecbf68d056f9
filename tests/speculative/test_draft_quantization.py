"""The bf16 and int8 draft heads (--speculative-draft-model-quantization bf16|int8): the engine drafts exactly
what the head with its weights rounded so drafts in the reference generator, outputs stay the target's, and
where they cannot run they are refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.engine import PROMPTS, first_drafts, make_llm
from tsengine.entrypoints.llm import LLM
from tsengine.errors import UserError
from tsengine.infer.reference import ReferenceSpeculator, SpecShape
from tsengine.model.kernels import rows_linear
from tsengine.model.linear import round_weights
from tsengine.sampling_params import SamplingParams

needs_kernel = pytest.mark.skipif(not rows_linear.available(), reason="needs g++ and an AVX2/FMA CPU")


QUANTIZATIONS = ["bf16", "int8"]


def _int8_spec(head, steps=3, quantization="int8", **extra):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": steps,
            "adaptive": False, "quantization": quantization,
            **extra}


def _coarse_head(heads, hf, out_dir):
    """The tiny head made sensitive to rounding, so each rounded head drafts other tokens than the fp32 one
    (a test that the engine ran the rounded model can fail): one outlier column in every weight of the layer
    (int8 then rounds the rest coarsely), and output rows within a bf16 step or two of a shared 1.0 (bf16
    rounding then reorders the logits). The three heads draft three different tokens here."""
    from tsengine.eagle3.format import load_head, save_head

    head = load_head(heads["llama"], target=hf.config, embeddings=hf.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = head.lm_head.weight
        out.copy_(1 + 0.002 * torch.randn(out.shape, generator=g))
        for lin in head.modules():
            if isinstance(lin, torch.nn.Linear) and lin is not head.lm_head:
                lin.weight[:, 0] = 20 * lin.weight.abs().amax()
    save_head(head, out_dir)
    return head


@needs_kernel
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_engine_drafts_equal_the_reference_drafter_on_the_rounded_head(tiny_dirs, tiny_models, heads, tmp_path,
                                                                       quantization):
    import copy

    hf, _ = tiny_models["llama"]
    head = _coarse_head(heads, hf, tmp_path)
    fp32 = ReferenceSpeculator(hf, head, SpecShape(3, 1, 4))
    ref = ReferenceSpeculator(hf, round_weights(copy.deepcopy(head), quantization), SpecShape(3, 1, 4))
    prompt = PROMPTS[2]
    for budget in (64, 7):  # the prompt extended in one pass (rounded fp32) and in few-row chunks (the kernel)
        llm = LLM(str(tiny_dirs["llama"]), speculative_config=_int8_spec(tmp_path, quantization=quantization),
                  debug_checks=True, block_size=4, max_num_batched_tokens=budget)
        tokens, drafts = first_drafts(llm, prompt)
        with torch.no_grad():
            feats = ref._target(tokens[:-1])[1]
            want = ref.draft(tokens, feats).tokens
            assert want != fp32.draft(tokens, feats).tokens, f"{quantization} must change this head's drafts"
        assert drafts == want, f"chunk budget {budget}"


@needs_kernel
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)])
def test_outputs_with_a_rounded_head_are_the_targets(tiny_dirs, tiny_models, heads, shape, tmp_path, quantization):
    """With the coarse head, whose rounded drafts differ from its fp32 ones (the first test)."""
    _coarse_head(heads, tiny_models["llama"][0], tmp_path)
    s, k, n = shape
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=11)]
    prompts = PROMPTS[:2]
    plain = make_llm(tiny_dirs).generate(prompts, params)
    llm = LLM(str(tiny_dirs["llama"]), debug_checks=True, block_size=4, max_num_batched_tokens=16,
              speculative_config=_int8_spec(tmp_path, s, quantization, eagle_topk=k, num_draft_tokens=n))
    head = llm.engine.runner.head
    stacked = {id(m) for lins in head.midlayer.fusable().values() for m in lins}  # served by `fused`
    alone = [m for m in head.modules() if isinstance(m, torch.nn.Linear) and id(m) not in stacked]
    served = [m.forward for m in alone] + list(head.midlayer.fused.values())
    low = {"bf16": torch.bfloat16, "int8": torch.int8}[quantization]
    assert alone and all(f.panels.dtype == low for f in served), f"the head must be served in {quantization}"
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats.num_drafts > 0


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_without_the_kernel_a_rounded_head_is_refused_by_name(tiny_dirs, heads, monkeypatch, quantization):
    """No AVX2, no g++ or TSENGINE_ROWS_LINEAR=0: the head would run at fp32 speed and draft worse."""
    monkeypatch.setattr(rows_linear, "available", lambda: False)
    with pytest.raises(UserError, match=re.escape(f"speculative_draft_model_quantization {quantization}: the "
                                                  "few-row kernel is unavailable")):
        LLM(str(tiny_dirs["llama"]), speculative_config=_int8_spec(heads["llama"], quantization=quantization))


@pytest.mark.parametrize("kw, msg", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "quantization": "int8"}},
     "speculative_draft_model_quantization int8 quantizes an EAGLE3 head; NGRAM has none"),
    ({"speculative_config": {"method": "eagle3", "model": "x", "quantization": "int4"}},
     "draft_model_quantization"),
    ({"dtype": "bfloat16"}, "speculative_draft_model_quantization int8: the CPU float32 head's format"),
    ({"dtype": "bfloat16", "speculative_config": {"method": "eagle3", "model": "HEAD", "quantization": "bf16"}},
     "speculative_draft_model_quantization bf16: the CPU float32 head's format"),
])
def test_where_int8_cannot_run_it_is_refused_by_name(tiny_dirs, heads, kw, msg):
    kw = {"speculative_config": _int8_spec(heads["llama"]), **kw}
    if kw["speculative_config"].get("model") == "HEAD":
        kw["speculative_config"]["model"] = str(heads["llama"])
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
def test_compiled_rounded_and_fp32_heads_each_draft_their_own_eager_drafts(tiny_dirs, tiny_models, heads, tmp_path,
                                                                            monkeypatch):
    """Three compiled engines in one process, the same head file in fp32, bf16 and int8: each one's drafts
    equal its eager twin's, and they differ (the graphs call each head's own kernel and weights)."""
    monkeypatch.setenv("TSENGINE_ENFORCE_EAGER", "0")
    _coarse_head(heads, tiny_models["llama"][0], tmp_path)

    def llm(quant, eager):
        return LLM(str(tiny_dirs["llama"]), enforce_eager=eager, debug_checks=True, block_size=4,
                   max_num_batched_tokens=16, speculative_config=_int8_spec(tmp_path, quantization=quant))

    prompts = PROMPTS[:2]
    compiled = {quant: llm(quant, False) for quant in ("none", *QUANTIZATIONS)}
    got = {quant: _recorded_drafts(engine, prompts) for quant, engine in compiled.items()}
    for quant in got:
        assert got[quant] == _recorded_drafts(llm(quant, True), prompts), quant
        assert compiled[quant].engine.proposer.graphs.graphs, f"the {quant} head's chain never ran through a graph"
    assert got["none"] != got["bf16"] and got["none"] != got["int8"] and got["bf16"] != got["int8"]
