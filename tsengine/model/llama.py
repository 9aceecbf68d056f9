"""Our own Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a flat varlen batch.

Why not HF's modeling code: the engine needs one forward over a mixed batch of prefill chunks and verify
windows that reads and writes a paged KV cache, returns the three aux hidden states EAGLE-3 drafts from,
and computes logits only for the rows that are sampled. The differences between the families are data,
not code: Qwen2 has q/k/v biases, Qwen3 has per-head q/k RMSNorm, all share RoPE (HF's rotary embedding
computes every scaling type) and SwiGLU. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tsengine.errors import UserError
from tsengine.model.attention import paged_attention, write_kv
from tsengine.model.context import Context
from tsengine.model.linear import Linear

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32 like HF's LlamaRMSNorm, so logits match it to rounding. For fp32 inputs torch's fused
    kernel gives the same bits in one op instead of six."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_matrices(cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE at each token's position as one [d, d] matrix per token: y = x·cos + [-x2, x1]·sin
    is y = x @ (diag(cos) + P·sin) with P the half-roll permutation. Built once per forward from the
    position tables, it turns RoPE in every layer into one batched matmul over q and k heads together
    (two nonzero terms per output, so the values are HF's up to fma rounding)."""
    d = cos.shape[-1]
    j = torch.arange(d, device=cos.device)
    roll = (j[:, None] == (j[None] - d // 2) % d).to(cos.dtype)  # roll[i, j] = 1 where x_i lands at j
    return torch.diag_embed(cos) + roll * signed_sin[:, None, :]


class Layer(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d, self.eps = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rms_norm_eps
        e = lambda *s: nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.qkv = e((self.nh + 2 * self.nkv) * d, h)
        self.qkv_bias = e((self.nh + 2 * self.nkv) * d) if cfg.qkv_bias else None
        self.q_norm = e(d) if cfg.qk_norm else None
        self.k_norm = e(d) if cfg.qk_norm else None
        self.o = e(h, self.nh * d)
        self.gate_up = e(2 * cfg.intermediate_size, h)
        self.down = e(h, cfg.intermediate_size)
        self.ln1, self.ln2 = e(h), e(h)
        self.fast: dict[str, Linear] = {}

    def prepare(self) -> None:
        """After the weights are loaded: the matmuls' fast forms (see `Linear`). gate and up stay one
        matmul: two half-size oneDNN calls cost more than the SiLU and product they'd fuse (measured:
        docs/benchmarks-journal.md, "Engine decode speed (issue 4)")."""
        self.fast = {"qkv": Linear(self.qkv, self.qkv_bias), "o": Linear(self.o), "gate_up": Linear(self.gate_up),
                     "down": Linear(self.down)}

    def forward(self, x, rope, kv, ctx: Context, backend: str):
        t, f, qk_width = x.shape[0], self.fast, (self.nh + self.nkv) * self.d
        qkv = f["qkv"](rms_norm(x, self.ln1, self.eps))
        qk, v = qkv[:, :qk_width].view(t, self.nh + self.nkv, self.d), qkv[:, qk_width:].view(t, self.nkv, self.d)
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :self.nh], self.q_norm, self.eps),
                            rms_norm(qk[:, self.nh:], self.k_norm, self.eps)], dim=1)
        qk = torch.bmm(qk, rope)  # q and k heads rotated in one op
        write_kv(kv[0], kv[1], qk[:, self.nh:], v, ctx)
        a = paged_attention(qk[:, :self.nh], kv[0], kv[1], ctx, self.d ** -0.5, backend)
        x = f["o"].add(a.reshape(t, -1), x)
        h = rms_norm(x, self.ln2, self.eps)
        gate, up = f["gate_up"](h).chunk(2, dim=-1)
        return f["down"].add(F.silu(gate) * up, x)


class ModelConfig:
    """The fields the decoder reads, from a HF config (any supported family)."""

    def __init__(self, hf):
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED:
            raise UserError(f"model_type {mt!r} is not supported; supported: {', '.join(sorted(SUPPORTED))}")
        window = getattr(hf, "sliding_window", None)
        if mt == "mistral" and window is not None and getattr(hf, "use_sliding_window", True) \
                and window < hf.max_position_embeddings:
            raise UserError(f"sliding_window {window} < max_position_embeddings: sliding-window attention "
                            "is not supported")
        self.hf, self.model_type = hf, mt
        self.hidden_size, self.num_hidden_layers = hf.hidden_size, hf.num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = hf.num_attention_heads, hf.num_key_value_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.intermediate_size, self.vocab_size = hf.intermediate_size, hf.vocab_size
        self.rms_norm_eps = hf.rms_norm_eps
        self.max_position_embeddings = hf.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.qkv_bias = mt == "qwen2" or bool(getattr(hf, "attention_bias", False))
        self.qk_norm = mt == "qwen3"
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise UserError(f"hidden_act {hf.hidden_act!r} is not supported; supported: silu")


class LlamaModel(nn.Module):
    """forward(input_ids [T], ctx, kv_caches) -> (final-normed hidden [T, H], aux [T, 3H] or None)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, aux_layer_ids=(), backend: str = "torch"):
        super().__init__()
        self.cfg, self.dtype, self.backend = cfg, dtype, backend
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(Layer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else \
            nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self._cos = self._sin = None

    def rope_tables(self, max_len: int) -> None:
        """cos/sin for every position once (HF's rotary class: every rope_type), fp32 math, then cast."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf = self.cfg.hf
        rot = LlamaRotaryEmbedding(hf).to(self.embed.device)
        pos = torch.arange(max_len, device=self.embed.device)[None]
        cos, sin = rot(torch.zeros(1, dtype=torch.float32, device=self.embed.device), pos)
        h = sin.shape[-1] // 2
        self._cos, self._sin = cos[0].to(self.dtype), torch.cat([-sin[0, :, :h], sin[0, :, h:]], dim=-1).to(self.dtype)

    def forward(self, input_ids: torch.Tensor, ctx: Context, kv_caches):
        x = F.embedding(input_ids, self.embed)
        rope = rope_matrices(self._cos[ctx.positions], self._sin[ctx.positions])
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_caches[i], ctx, self.backend)
            if i in self.aux_layer_ids:
                captured[i] = x  # the residual stream after layer i: HF's hidden_states[i + 1]
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps), aux

    def prepare(self) -> None:
        for layer in self.layers:
            layer.prepare()
        self.head_linear = Linear(self.lm_head)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_linear(hidden).float()


# ---- loading ----------------------------------------------------------------------------------------
def _tensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors weights (only safetensors checkpoints are loaded)")
    return files


def load_model(path: str | Path, hf_config, dtype: torch.dtype, device, aux_layer_ids=(),
               backend: str = "torch", max_len: int | None = None) -> LlamaModel:
    """Build the decoder and fill it from a HF safetensors directory, fusing q/k/v and gate/up."""
    cfg = ModelConfig(hf_config)
    path = Path(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, dtype, aux_layer_ids, backend)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head = model.embed
    raw: dict[str, torch.Tensor] = {}
    for f in _tensor_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                raw[name.removeprefix("model.")] = fh.get_tensor(name)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise UserError(f"{path}: weight {name!r} missing from the checkpoint")
        used.add(name)
        return raw[name]

    def put(param: torch.Tensor, value: torch.Tensor) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise UserError(f"{path}: weight shape {tuple(value.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(value.to(dtype))

    with torch.no_grad():
        put(model.embed, take("embed_tokens.weight"))
        put(model.norm, take("norm.weight"))
        if not cfg.tie_word_embeddings:
            put(model.lm_head, take("lm_head.weight"))
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            put(layer.qkv, torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]))
            if layer.qkv_bias is not None:
                put(layer.qkv_bias, torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]))
            if layer.q_norm is not None:
                put(layer.q_norm, take(a + "q_norm.weight"))
                put(layer.k_norm, take(a + "k_norm.weight"))
            put(layer.o, take(a + "o_proj.weight"))
            put(layer.gate_up, torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            put(layer.down, take(p + "mlp.down_proj.weight"))
            put(layer.ln1, take(p + "input_layernorm.weight"))
            put(layer.ln2, take(p + "post_attention_layernorm.weight"))
    extra = set(raw) - used - {"lm_head.weight"} - {k for k in raw if "rotary_emb" in k}
    if extra:
        raise UserError(f"{path}: unexpected weights {sorted(extra)[:5]} (not a {cfg.model_type} checkpoint?)")
    model.rope_tables(max_len or cfg.max_position_embeddings)
    model.prepare()
    return model.eval()
