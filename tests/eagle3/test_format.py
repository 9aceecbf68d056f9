"""Export format: exact keys, config fields, bit-equal round trip, and every refusal the loader makes."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.heads import random_head
from tsengine.eagle3.format import EXPORT_KEYS, load_head, save_head
from tsengine.errors import UserError

KEYS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture()
def exported(tiny_models, tmp_path):
    model, _ = tiny_models["llama"]
    counts = torch.arange(model.config.vocab_size, dtype=torch.float64).flip(0)  # favours low ids
    counts[5] = 1e9
    head = random_head(model, seed=3, draft_vocab_size=100, counts=counts)
    return model, head, save_head(head, tmp_path / "head")


def test_exact_key_set_and_dtypes(exported):
    _, _, d = exported
    tensors = load_file(d / "model.safetensors")
    assert set(tensors) == KEYS == set(EXPORT_KEYS)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.float32 for k, t in tensors.items() if k not in ("d2t", "t2d"))
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]


def test_config_fields(exported):
    model, head, d = exported
    c = json.loads((d / "config.json").read_text())
    L = model.config.num_hidden_layers
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["num_hidden_layers"] == 1
    assert c["hidden_size"] == c["target_hidden_size"] == model.config.hidden_size
    assert c["vocab_size"] == model.config.vocab_size and c["draft_vocab_size"] == 100
    assert c["intermediate_size"] == model.config.intermediate_size
    assert c["num_attention_heads"] == 4 and c["num_key_value_heads"] == 2
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, L // 2 - 1, L - 4]
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]  # vLLM's reading: layer inputs
    assert c["rope_parameters"]["rope_theta"] == c["rope_theta"] == 10000.0
    assert c["rope_scaling"] is None and c["norm_before_residual"] is False


def test_round_trip_is_bit_equal(exported):
    model, head, d = exported
    loaded = load_head(d, target=model.config, embeddings=model.get_input_embeddings().weight)
    a, b = head.exported_state_dict(), loaded.exported_state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert loaded.config == head.config
    assert loaded.to_target(torch.tensor([0])).item() in (torch.arange(100) + loaded.d2t).tolist()
    assert 5 in (torch.arange(100) + loaded.d2t).tolist()  # the most frequent token made the draft vocab


def test_bf16_export_and_optional_embeddings(exported, tmp_path):
    model, head, d = exported
    tensors = load_file(d / "model.safetensors")
    tensors = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in tensors.items()}
    tensors["embed_tokens.weight"] = torch.randn(model.config.vocab_size, model.config.hidden_size).bfloat16()
    out = tmp_path / "bf16"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    c = json.loads((d / "config.json").read_text())
    c["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(c))
    loaded = load_head(out, target=model.config)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.embed_tokens.weight, tensors["embed_tokens.weight"])


def _mutate(d, tmp_path, tensors=None, config=None):
    out = tmp_path / "bad"
    out.mkdir(exist_ok=True)
    t = load_file(d / "model.safetensors")
    c = json.loads((d / "config.json").read_text())
    if tensors:
        tensors(t)
    if config:
        config(c)
    save_file(t, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(c))
    return out


def _refuse(model, path, *needles):
    with pytest.raises(UserError) as e:
        load_head(path, target=model.config)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def _shift_d2t(t):
    t["d2t"] = t["d2t"] + 10_000


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


MISMATCHES = {
    "missing key": (lambda t: t.pop("norm.weight"), None, ["missing keys ['norm.weight']"]),
    "prefixed keys": (lambda t: t.__setitem__("draft_model.fc.weight", t.pop("fc.weight")), None,
                      ["unexpected keys ['draft_model.fc.weight']", "missing keys ['fc.weight']"]),
    "wrong shape": (_set("fc.weight", torch.zeros(64, 100)), None, ["fc.weight has shape [64, 100]"]),
    "d2t dtype": (lambda t: t.__setitem__("d2t", t["d2t"].int()), None, ["d2t has dtype torch.int32"]),
    "t2d dtype": (lambda t: t.__setitem__("t2d", t["t2d"].long()), None, ["t2d has dtype torch.int64"]),
    "d2t range": (_shift_d2t, None, ["outside the target vocab"]),
    "t2d disagrees": (lambda t: t["t2d"].copy_(torch.roll(t["t2d"], 1)), None, ["t2d disagrees with d2t"]),
    "mixed dtypes": (lambda t: t.__setitem__("norm.weight", t["norm.weight"].half()), None, ["mix dtypes"]),
    "int weights": (lambda t: t.__setitem__("norm.weight", t["norm.weight"].long()), None,
                    ["norm.weight has dtype torch.int64"]),
    "target hidden": (None, lambda c: c.update(target_hidden_size=32),
                      ["target_hidden_size is 32", "fc.weight has shape"]),
    "vocab": (None, lambda c: c.update(vocab_size=500), ["vocab_size is 500"]),
    "layer ids": (None, lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]},
                                            eagle_aux_hidden_state_layer_ids=None), ["[8] not in 0..7"]),
    "ids disagree": (None, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4]), ["disagrees with"]),
    "unknown key": (None, lambda c: c.update(draft_vocab=3), ["unknown keys ['draft_vocab']"]),
    "architecture": (None, lambda c: c.update(architectures=["Qwen2ForCausalLM"]),
                     ["expected ['LlamaForCausalLMEagle3']"]),
    "layers": (None, lambda c: c.update(num_hidden_layers=2), ["exactly 1"]),
    "dtype": (None, lambda c: c.update(torch_dtype="int8"), ["torch_dtype is 'int8'"]),
    "rope type": (None, lambda c: c.update(rope_parameters={"rope_type": "bogus", "rope_theta": 1.0}),
                  ["rope_type is 'bogus'"]),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_each_mismatch_is_refused_by_name(exported, tmp_path, case):
    model, _, d = exported
    tensors, config, needles = MISMATCHES[case]
    _refuse(model, _mutate(d, tmp_path, tensors, config), *needles)


def test_one_message_names_every_offending_field(exported, tmp_path):
    model, _, d = exported
    bad = _mutate(d, tmp_path, lambda t: (t.pop("lm_head.weight"), _shift_d2t(t)),
                  lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 9]},
                                     eagle_aux_hidden_state_layer_ids=None))
    _refuse(model, bad, "missing keys ['lm_head.weight']", "outside the target vocab", "[9] not in 0..7")


def test_unreadable_files(exported, tmp_path):
    model, _, d = exported
    _refuse(model, tmp_path / "nope", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refuse(model, empty, "config.json is missing")
    (empty / "config.json").write_text("{not json")
    _refuse(model, empty, "is not valid JSON")
    (empty / "config.json").write_text((d / "config.json").read_text())
    _refuse(model, empty, "model.safetensors is missing")
    (empty / "model.safetensors").write_bytes(b"\x00" * 64)
    _refuse(model, empty, "not a readable safetensors file")
