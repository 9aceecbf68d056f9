"""The one EAGLE-3 head: its data flow, its KV cache, its RoPE, and where its features come from."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.helpers.heads import random_head
from tsengine.eagle3.config import Eagle3Config, default_aux_layer_ids
from tsengine.eagle3.head import Eagle3Head, aux_hidden_states


def test_default_aux_layers_are_sglangs_capture_points():
    # outputs of layers 1, L/2-1, L-4 == inputs of layers 2, L/2, L-3
    assert default_aux_layer_ids(30) == (1, 14, 26)
    assert default_aux_layer_ids(32) == (1, 15, 28)


def test_aux_features_are_the_outputs_of_the_named_layers(tiny_models):
    model, _ = tiny_models["llama"]
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: captured.__setitem__(k, o[0] if isinstance(o, tuple)
                                                                                  else o))
             for k, layer in enumerate(model.model.layers)]
    ids = torch.randint(0, 300, (1, 7))
    out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    ids_ = default_aux_layer_ids(model.config.num_hidden_layers)
    expect = torch.cat([captured[i] for i in ids_], dim=-1)
    assert torch.equal(aux_hidden_states(out.hidden_states, ids_), expect)


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rot(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def naive_step(head, emb, h, positions):
    """EAGLE-3's layer written out by hand: the definition the module must equal."""
    c, sd = head.config, {k: v.float() for k, v in head.state_dict().items()}
    eps, t = c.rms_norm_eps, emb.shape[0]
    x = torch.cat([_rms(emb, sd["midlayer.input_layernorm.weight"], eps),
                   _rms(h, sd["midlayer.hidden_norm.weight"], eps)], -1)
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, c.num_attention_heads, c.head_dim).transpose(0, 1)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    inv = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q, k = _rot(q, cos, sin), _rot(k, cos, sin)
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(1, 2) / c.head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1) @ sd["midlayer.self_attn.o_proj.weight"].T
    a = h + o  # residual is the incoming hidden state
    n = _rms(a, sd["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(n @ sd["midlayer.mlp.gate_proj.weight"].T)
           * (n @ sd["midlayer.mlp.up_proj.weight"].T))
    out = a + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    return out, _rms(out, sd["norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_head_matches_the_hand_written_definition(tiny_models, kind):
    model, _ = tiny_models[kind]
    head = random_head(model, seed=1, draft_vocab_size=200)
    t = 6
    ids = torch.randint(0, 300, (t,))
    aux = torch.randn(t, 3 * model.config.hidden_size)
    positions = torch.arange(3, 3 + t)
    with torch.no_grad():
        h = head.project(aux[None])
        out, logits, _ = head(ids[None], h, positions[None])
        ref_out, ref_logits = naive_step(head, head.embed(ids), h[0], positions)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=1e-5)
    assert logits.shape[-1] == 200


def test_kv_cache_equals_one_pass(tiny_models):
    model, _ = tiny_models["llama"]
    head = random_head(model)
    ids = torch.randint(0, 300, (1, 5))
    h = torch.randn(1, 5, head.config.hidden_size)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        full, _, _ = head(ids, h, pos)
        kv, outs = None, []
        for i in range(5):
            o, _, kv = head(ids[:, i:i + 1], h[:, i:i + 1], pos[:, i:i + 1], past_kv=kv)
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_follows_the_target_config(name):
    target = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=ROPES[name])
    cfg = Eagle3Config.for_target(target, draft_vocab_size=50)
    assert cfg.rope_parameters["rope_type"] == name
    assert Eagle3Config.from_hf_dict(cfg.to_hf_dict()) == cfg  # survives the config.json round trip
    head = Eagle3Head(cfg)
    head.init_weights(0)
    head.bind_embeddings(torch.randn(100, 32))
    pos = torch.arange(0, 200, 7)[None]
    x = torch.zeros(1, 1, 32)
    cos, sin = head.rope(pos, x)
    tcos, tsin = LlamaRotaryEmbedding(target)(x, pos)
    assert torch.equal(cos, tcos) and torch.equal(sin, tsin)
    head.place("cpu", torch.bfloat16)  # RoPE frequencies stay fp32 when the weights go bf16
    assert head.rotary.inv_freq.dtype == torch.float32
    out, logits, _ = head(torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 32, dtype=torch.bfloat16), torch.arange(3)[None])
    assert logits.shape == (1, 3, 50) and logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_init_from_target_copies_the_read_out_of_draft_ids(tiny_models):
    model, _ = tiny_models["qwen3"]
    head = random_head(model, seed=4, draft_vocab_size=50, counts=torch.rand(model.config.vocab_size))
    head.init_from_target(model)
    ids = torch.arange(50) + head.d2t
    assert torch.equal(head.lm_head.weight, model.get_output_embeddings().weight[ids])
    assert torch.equal(head.norm.weight, model.model.norm.weight)


@pytest.mark.parametrize("quantization", ["none", "bf16", "int8"])
def test_the_served_head_fuses_its_projections_to_the_same_bits(tiny_models, quantization, monkeypatch):
    """`accelerate` runs q/k/v as one matmul and gate/up as one: every output the same bits as the separate
    served matmuls give, for few rows (our kernel) and many (oneDNN)."""
    from tsengine.eagle3.head import DraftLayer
    from tsengine.model.kernels import rows_linear
    from tsengine.model.linear import accelerate

    if quantization != "none" and not rows_linear.available():
        pytest.skip(f"{quantization} needs the few-row kernel")
    model, _ = tiny_models["llama"]
    head = accelerate(random_head(model, seed=2, draft_vocab_size=200), quantization)
    assert set(head.midlayer.fused) == {"qkv", "gate_up"}
    monkeypatch.setattr(DraftLayer, "fusable", lambda self: {})
    separate = accelerate(random_head(model, seed=2, draft_vocab_size=200), quantization)
    assert separate.midlayer.fused is None
    for rows in (1, 4, rows_linear.MAX_ROWS + 3):
        emb, hidden = torch.randn(2, 1, rows, head.config.hidden_size).unbind(0)
        cos, sin = head.rope(torch.arange(rows)[None], hidden)
        attn = torch.randn(1, head.config.num_attention_heads, rows, head.config.head_dim)
        with torch.no_grad():
            got, want = ((*m.midlayer.qkv(emb, hidden, cos, sin), m.midlayer.finish(attn, hidden))
                         for m in (head, separate))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), rows


def test_a_served_head_moved_after_fusing_drops_its_stale_copies(tiny_models):
    from tsengine.model.linear import accelerate

    model, _ = tiny_models["llama"]
    head = accelerate(random_head(model, seed=2, draft_vocab_size=200), "none")
    assert head.midlayer.fused is not None
    head.to(torch.float64)
    assert head.midlayer.fused is None
