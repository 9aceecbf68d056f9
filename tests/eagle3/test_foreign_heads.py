"""Heads other trainers write load as tsengine's (tsengine/eagle3/foreign.py): SpecForge's, the EAGLE
repository's and vLLM speculators' layouts of one head load to the same weights and the engine drafts the
same tokens from each; speculators' extra norms run in the engine as in the dense reference; what no layout
of tsengine's head can run is refused naming the field. The foreign files are written here from each
project's own conventions (docs/interop.md), not by tsengine's exporter, except the speculators export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.engine import PROMPTS, first_drafts, make_llm
from tests.helpers.heads import random_head
from tsengine.eagle3.export import export_checkpoint
from tsengine.eagle3.format import load_head, save_head
from tsengine.errors import UserError
from tsengine.infer.reference import ReferenceSpeculator, SpecShape


def _files(d):
    return json.loads((d / "config.json").read_text()), load_file(d / "model.safetensors")


def _write(out, config, tensors):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    return out


def specforge(src):
    """SpecForge's HF export: aux ids only nested (layer outputs), its `norm_output` (the norm before lm_head),
    the target's embeddings copied in."""
    c, t = _files(src)
    c.pop("eagle_aux_hidden_state_layer_ids")
    c.pop("rope_parameters")
    c.update(norm_output=True, fc_norm=False)
    return c, t


def eagle(src):
    """The EAGLE repository: a plain LlamaConfig, no aux ids (fixed by convention), no head_dim (hidden /
    heads), no target_hidden_size."""
    c, t = _files(src)
    for k in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "head_dim", "target_hidden_size",
              "rope_parameters", "norm_before_residual", "rope_scaling"):
        c.pop(k)
    c["architectures"] = ["LlamaForCausalLM"]
    if c["draft_vocab_size"] == c["vocab_size"]:  # EAGLE drops the map where the vocab is the target's
        t.pop("d2t"), t.pop("t2d")
    return c, t


def speculators_layout(src, out, target, tiny_dir):
    """tsengine's own `export --format speculators`, then as speculators leaves a full-vocab head: no map."""
    export_checkpoint(src, out, target=target, fmt="speculators", verifier=str(tiny_dir))
    c, t = _files(out)
    if c["draft_vocab_size"] == c["transformer_layer_config"]["vocab_size"]:
        t.pop("d2t"), t.pop("t2d")
    return c, t


@pytest.fixture(scope="module")
def full_vocab_head(tiny_models, tmp_path_factory):
    model, _ = tiny_models["llama"]
    head = random_head(model, seed=5, draft_vocab_size=model.config.vocab_size)
    head.init_weights(5, std=0.3)
    return save_head(head, tmp_path_factory.mktemp("full-vocab"))


@pytest.mark.parametrize("fmt", ["specforge", "eagle", "speculators"])
@pytest.mark.parametrize("vocab", ["draft vocab", "full vocab"])
def test_a_foreign_layout_loads_the_same_head_and_drafts_the_same_tokens(tiny_dirs, tiny_models, heads,
                                                                         full_vocab_head, tmp_path, fmt, vocab):
    hf, _ = tiny_models["llama"]
    src = heads["llama"] if vocab == "draft vocab" else full_vocab_head
    out = tmp_path / fmt
    if fmt == "speculators":
        c, t = speculators_layout(src, out, hf.config, tiny_dirs["llama"])
        assert any(k.startswith("layers.0.") for k in t) and "speculators_config" in c
    else:
        c, t = (specforge if fmt == "specforge" else eagle)(src)
    _write(out, c, t)
    ours, theirs = load_head(src, target=hf.config), load_head(out, target=hf.config)
    assert theirs.config == ours.config
    a, b = ours.exported_state_dict(), theirs.exported_state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for prompt in PROMPTS[:3]:
        assert first_drafts(make_llm(tiny_dirs, "llama", out), prompt) == \
            first_drafts(make_llm(tiny_dirs, "llama", src), prompt), (fmt, prompt)


def test_speculators_norms_run_in_the_engine_as_in_the_dense_reference(tiny_dirs, tiny_models, heads, tmp_path):
    """A speculators head with every extra norm on (their weights away from 1, so each one matters): the
    engine's drafts equal the dense reference's (infer/reference.py, `Eagle3Head.forward`) and differ from
    the same weights without the norms; decoding with it stays the target's greedy output."""
    hf, _ = tiny_models["llama"]
    out = tmp_path / "spec"
    c, t = speculators_layout(heads["llama"], out, hf.config, tiny_dirs["llama"])
    c.update(norm_before_residual=True, norm_before_fc=True, fc_norm=True, norm_output=True)
    g = torch.Generator().manual_seed(0)
    ht = c["target_hidden_size"]
    t["input_norm.weight"] = 1 + 0.5 * torch.randn(3 * ht, generator=g)
    for i in range(3):
        t[f"fc_norm.{i}.weight"] = 1 + 0.5 * torch.randn(ht, generator=g)
    t["norm.weight"] = 1 + 0.5 * torch.randn(t["norm.weight"].shape, generator=g)
    _write(out, c, t)
    head = load_head(out, target=hf.config, embeddings=hf.get_input_embeddings().weight)
    assert head.config.norm_output and head.config.fc_norm and not head.config.reference_layout
    ref = ReferenceSpeculator(hf, head, SpecShape(3, 1, 4))
    plain = dict(c, norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False)
    _write(tmp_path / "plain", plain, {k: v for k, v in t.items() if "fc_norm" not in k and "input_norm" not in k})
    changed = False
    for prompt in PROMPTS[:3]:
        tokens, drafts = first_drafts(make_llm(tiny_dirs, "llama", out), prompt)
        with torch.no_grad():
            assert drafts == ref.draft(tokens, ref._target(tokens[:-1])[1]).tokens, prompt
        changed |= drafts != first_drafts(make_llm(tiny_dirs, "llama", tmp_path / "plain"), prompt)[1]
    assert changed, "the norms must change some drafts, or this test proves nothing"
    from tsengine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(tiny_dirs, "llama").generate(PROMPTS, sp)]
    assert [o.outputs[0].token_ids for o in make_llm(tiny_dirs, "llama", out).generate(PROMPTS, sp)] == want
    with pytest.raises(UserError, match="--format speculators"):
        save_head(head, tmp_path / "as-sglang")  # the SGLang config cannot say these norms


def _refused(tiny_models, d, *needles):
    with pytest.raises(UserError) as e:
        load_head(d, target=tiny_models["llama"][0].config)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_heads_tsengine_cannot_serve_are_refused_naming_the_field(tiny_dirs, tiny_models, heads, tmp_path):
    hf, _ = tiny_models["llama"]
    c, t = speculators_layout(heads["llama"], tmp_path / "s", hf.config, tiny_dirs["llama"])
    for name, change, needle in [
        ("qwen3", lambda c: c["transformer_layer_config"].update(model_type="qwen3"),
         "transformer_layer_config.model_type is 'qwen3'"),
        ("two layers", lambda c: c["transformer_layer_config"].update(num_hidden_layers=2),
         "transformer_layer_config.num_hidden_layers is 2"),
        ("four aux", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]), "has 4 ids"),
    ]:
        bad = json.loads(json.dumps(c))
        change(bad)
        _refused(tiny_models, _write(tmp_path / name, bad, t), needle)
    no_map = {k: v for k, v in t.items() if k not in ("d2t", "t2d")}
    _refused(tiny_models, _write(tmp_path / "no map", c, no_map), "no d2t/t2d", "draft_vocab_size (256)")
    sc, st = specforge(heads["llama"])
    _refused(tiny_models, _write(tmp_path / "sf", dict(sc, norm_output=False), st), "norm_output is false")
    ec, et = eagle(heads["llama"])
    _refused(tiny_models, _write(tmp_path / "bias", dict(ec, bias=True), et), "bias is true")
    _refused(tiny_models, _write(tmp_path / "no midlayer", ec, {k.replace("midlayer.", "layer."): v
                                                               for k, v in et.items()}), "no 'midlayer.' tensors")
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(ec))
    torch.save(et, pickled / "pytorch_model.bin")
    _refused(tiny_models, pickled, "safetensors only", "weights_only=True")


def test_export_speculators_needs_the_target_and_names_it(tiny_dirs, tiny_models, heads, tmp_path):
    hf, _ = tiny_models["llama"]
    with pytest.raises(UserError, match="needs --target"):
        export_checkpoint(heads["llama"], tmp_path / "x", fmt="speculators")
    with pytest.raises(UserError, match="format 'onnx'"):
        export_checkpoint(heads["llama"], tmp_path / "x", target=hf.config, fmt="onnx")
    c, _ = speculators_layout(heads["llama"], tmp_path / "s", hf.config, tiny_dirs["llama"])
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(tiny_dirs["llama"])
    assert c["speculators_model_type"] == "eagle3" and c["norm_before_residual"] is False
    L = hf.config.num_hidden_layers
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]  # layer inputs, vLLM's reading
