"""THE EAGLE-3 draft head: the one module the trainer trains and the engine runs.

Data flow of one draft step (EAGLE-3, as SGLang/vLLM implement it):

    aux features of target position t  ── fc ──┐ (step 0; later steps feed the head's own output)
                                               h ─┬─ hidden_norm ─┐
    token t+1 ── target embeddings ── input_layernorm ────────────┴─ cat (2H) ─ q/k/v ─ attn ─ o_proj
                                                  └───────── residual ───────────────────────── + ─ a
    out = a + mlp(post_attention_layernorm(a))     (pre-norm output: next step's h)
    logits = lm_head(norm(out)) over the draft vocab; target id = draft id + d2t[draft id]

That is the reference layout, the one tsengine trains. Heads from vLLM's `speculators` trainer may add norms
(`Eagle3Config.norm_before_fc`, `fc_norm`, `norm_before_residual`, `norm_output`), applied here so that every
caller runs them unchanged: `project`, `midlayer.finish`, `finish` and `logits` hold them.

The interface is deliberately small so the trainer (TTT unroll, its own masks) and the engine (paged
attention) can each drive the same weights: `embed`, `project`, `rope`, `midlayer.qkv` / `midlayer.finish`
(or `midlayer(...)` with dense attention and a KV cache), `finish`, `logits`, `to_target`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tsengine.eagle3.config import Eagle3Config

KV = tuple[torch.Tensor, torch.Tensor]


def _llama_config(cfg: Eagle3Config) -> LlamaConfig:
    """HF building blocks (RMSNorm, SwiGLU MLP, every RoPE scaling type) read a LlamaConfig."""
    return LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope_parameters),
        vocab_size=cfg.vocab_size, num_hidden_layers=1, mlp_bias=False, attention_bias=False,
    )


class DraftAttention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embedding ; hidden] concatenation."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)


class DraftLayer(nn.Module):
    """The single decoder layer (`midlayer`). Parameter names match the export format exactly."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        hf = _llama_config(cfg)
        self.self_attn = DraftAttention(cfg)
        self.mlp = LlamaMLP(hf)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual
        # Serving only (`tsengine.model.linear.accelerate`): q/k/v as one matmul and gate/up as one, each output the
        # same bits as its own matmul's: two kernel calls instead of five, a little less drafting per step
        # (measured: docs/benchmarks-journal.md, "The served head with fused projections, on a faster machine").
        self.fused: dict | None = None

    def _apply(self, fn, recurse=True):
        self.fused = None  # a move or cast would leave the stacked copies behind: serving fuses after placing
        return super()._apply(fn, recurse)

    def fusable(self) -> dict[str, list[nn.Linear]]:
        """The projections that read the same input, by the name `fused` keeps their one matmul under."""
        a, m = self.self_attn, self.mlp
        return {"qkv": [a.q_proj, a.k_proj, a.v_proj], "gate_up": [m.gate_proj, m.up_proj]}

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, H] x2 -> q [B, nh, T, d], k/v [B, nkv, T, d] with RoPE applied to q and k."""
        a = self.self_attn
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        b, t, _ = x.shape
        if self.fused is not None:
            kv_width = a.num_kv_heads * a.head_dim
            q, k, v = self.fused["qkv"](x).split([a.num_heads * a.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        q = q.reshape(b, t, a.num_heads, a.head_dim).transpose(1, 2)
        k = k.reshape(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = v.reshape(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attention output [B, nh, T, d] + residual `hidden` -> the layer's pre-norm output [B, T, H]."""
        b, _, t, _ = attn.shape
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        x = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        if self.fused is None:
            return x + self.mlp(h)
        gate, up = self.fused["gate_up"](h).chunk(2, dim=-1)
        return x + self.mlp.down_proj(self.mlp.act_fn(gate) * up)

    def forward(self, emb, hidden, cos, sin, mask: torch.Tensor | None = None, past_kv: KV | None = None):
        """Dense attention over `past_kv` + the new tokens.

        `mask` is boolean [B or 1, 1, T, past + T] (True = may attend); None means causal after all of
        the past. Returns (pre-norm output, the KV including the new tokens) so a caller can keep a cache.
        """
        q, k, v = self.qkv(emb, hidden, cos, sin)
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
        if mask is None:
            t, total = q.shape[2], k.shape[2]
            mask = torch.ones(t, total, dtype=torch.bool, device=q.device).tril(total - t)[None, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        return self.finish(o, hidden), (k, v)


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head, the draft vocab map (d2t, t2d) and the target's frozen embeddings."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        # The target's token embeddings, frozen and never exported: `bind_embeddings` shares the target's
        # tensor so the engine holds one copy. A head file that carries `embed_tokens.weight` binds that.
        self.embed_tokens: nn.Embedding | None = None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        ht = cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * ht, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(ht, eps=cfg.rms_norm_eps) for _ in range(3))
        self.midlayer = DraftLayer(cfg)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(_llama_config(cfg))  # buffers are non-persistent: not exported

    def place(self, device: str | torch.device, dtype: torch.dtype) -> "Eagle3Head":
        """Move weights to `device`/`dtype`, keeping RoPE frequencies in fp32 (a bf16 inv_freq drifts)."""
        self.to(device=device, dtype=dtype)
        self.reset_rope()
        return self

    def reset_rope(self) -> None:
        """Rebuild the RoPE frequencies in fp32 on the weights' device (a cast to bf16 shifts positions)."""
        self.rotary = LlamaRotaryEmbedding(_llama_config(self.config)).to(self.fc.weight.device)

    # ---- weights ------------------------------------------------------------------------------
    def bind_embeddings(self, weight: torch.Tensor) -> None:
        """Share the target's embedding tensor (frozen). Shape [vocab, hidden] must match the head."""
        expect = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expect:
            raise ValueError(f"target embeddings are {tuple(weight.shape)}, the head needs {expect}")
        self.embed_tokens = nn.Embedding.from_pretrained(weight.detach(), freeze=True)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random weights (an untrained head): N(0, std) linears, unit norms, deterministic in `seed`."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.exported_state_dict().items():
            if not p.is_floating_point():
                continue
            with torch.no_grad():
                if name.endswith("norm.weight") or name.startswith("fc_norm."):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start the output side from the target: lm_head = the target lm_head's rows of the draft ids,
        final norm = the target's final norm. The draft's job is to reproduce the target's next hidden
        state, so the target's own read-out is the right prior; from random rows, tokens rare in the
        training data would keep noise logits (call after `set_vocab_map`)."""
        rows = target.get_output_embeddings().weight
        ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        self.lm_head.weight.copy_(rows[ids.to(rows.device)].to(self.lm_head.weight))
        norm = getattr(getattr(target, "model", None), "norm", None)
        if norm is not None and tuple(norm.weight.shape) == tuple(self.norm.weight.shape):
            self.norm.weight.copy_(norm.weight.to(self.norm.weight))

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the keys of the interchange format: no embeddings, no rotary caches."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # ---- the interface ------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("bind_embeddings(target embedding weight) before drafting")
        return self.embed_tokens(input_ids)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Fuse the three target features (3·H_target wide) into the head's width. Step 0 only: later
        steps feed the head's own output, which is already H wide."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """cos/sin for integer `positions` [B, T], in `like`'s dtype and device."""
        return self.rotary(like, positions)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`midlayer.finish`, as the next draft step reads it: the pre-norm output, or with `norm_output`
        (speculators) the normed one."""
        out = self.midlayer.finish(attn, hidden)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits from `finish`'s output."""
        return self.lm_head(out if self.config.norm_output else self.norm(out))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, input_ids, hidden, positions, mask=None, past_kv: KV | None = None):
        """One dense pass over H-wide `hidden` (`project(aux)` or the head's own output).

        Returns (output as `finish` gives it, draft logits, KV including these tokens)."""
        emb = self.embed(input_ids).to(hidden.dtype)
        cos, sin = self.rope(positions, hidden)
        out, kv = self.midlayer(emb, hidden, cos, sin, mask=mask, past_kv=past_kv)
        if self.config.norm_output:
            out = self.norm(out)
        return out, self.logits(out), kv


def aux_hidden_states(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """Concatenate the outputs of target layers `layer_ids` from HF `output_hidden_states`.

    HF returns L+1 tensors: index 0 is the embedding output and index i+1 the output of layer i, so the
    output of layer i is `hidden_states[i + 1]` (the last one is post-norm, which no default id reaches).
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
