"""Heads other trainers write, read as tsengine's, and tsengine's written in vLLM's `speculators` format.

Three producers, three layouts of the same EAGLE-3 head (read from their own code: docs/interop.md):

- SGLang / SpecForge (tsengine's own export): a LlamaConfig with `architectures` "LlamaForCausalLMEagle3",
  `midlayer.*` tensors, aux layer ids as layer *outputs* in `eagle_config.eagle_aux_hidden_state_layer_ids`.
- The EAGLE repository: the same tensors under a plain "LlamaForCausalLM" config; aux layers fixed by
  convention (the inputs of layers 2, L/2 and L-3: the default here too), no `head_dim` (hidden / heads),
  RoPE theta 10000 unless given, `d2t`/`t2d` left out where the draft vocab is the target's.
- vLLM `speculators`: `speculators_config` + `transformer_layer_config`, `layers.0.*` tensors, top-level
  aux layer ids as layer *inputs*, and optional norms (`norm_before_residual`, which vLLM takes as true
  when absent; `norm_before_fc`, `fc_norm`, `norm_output`): `Eagle3Config` carries them and the head
  applies them (tsengine/eagle3/head.py).

`normalise` turns any of them into the SGLang config dict and tensor names that `Eagle3Config.from_hf_dict`
and `format.validate` check, so every head goes through one validation. What no layout of tsengine's head
can run (more than one layer, Qwen3's q/k norms, biases) is refused naming the field.
"""

from __future__ import annotations

from typing import Any

import torch

from tsengine.eagle3.config import ARCHITECTURE, Eagle3Config
from tsengine.errors import UserError

SPECULATORS = "speculators"
EAGLE = "eagle"
SGLANG = "sglang"  # SGLang, SpecForge and tsengine
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# speculators' transformer_layer_config keys that carry over to the head's LlamaConfig
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling",
               "rope_parameters", "attention_bias", "mlp_bias", "num_hidden_layers", "torch_dtype", "dtype")
_SPECULATORS_EXTRA = ("verifier_lm_head.weight", "verifier_norm.weight")  # the trainer's frozen copies, unused


def detect(raw: dict[str, Any]) -> str:
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return SPECULATORS
    if (raw.get("architectures") or ["LlamaForCausalLM"]) == ["LlamaForCausalLM"]:  # the EAGLE repository's
        return EAGLE
    return SGLANG  # whose reader names any other architecture


def normalise(raw: dict[str, Any], tensors: dict[str, torch.Tensor], where: str
              ) -> tuple[dict[str, Any], dict[str, bool], dict[str, torch.Tensor], str]:
    """(the SGLang config dict, flags it cannot say, tensors under tsengine's names, the format's name)."""
    fmt = detect(raw)
    flags: dict[str, bool] = {}
    if fmt == SPECULATORS:
        raw, flags = _from_speculators(raw, where)
        tensors = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
                   for k, v in tensors.items() if k not in _SPECULATORS_EXTRA}
    elif fmt == EAGLE:
        if not any(k.startswith("midlayer.") for k in tensors):
            raise UserError(f"{where}: architectures is {raw.get('architectures')} and the weights have no "
                            f"'midlayer.' tensors: not an EAGLE-3 head (expected [{ARCHITECTURE!r}])")
        if raw.get("bias"):  # the EAGLE repository's own switch for biased projections
            raise UserError(f"{where}: bias is true; tsengine serves heads without biases")
        raw = {**{k: v for k, v in raw.items() if k != "bias"}, "architectures": [ARCHITECTURE]}
    return raw, flags, _vocab_map(raw, tensors, where), fmt


def _from_speculators(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, bool]]:
    problems = []
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        problems.append(f"speculators_model_type is {kind!r}; tsengine serves 'eagle3'")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UserError(f"{where}: transformer_layer_config must be an object (the draft layer's config)")
    if layer.get("model_type", "llama") != "llama":
        problems.append(f"transformer_layer_config.model_type is {layer.get('model_type')!r}; tsengine serves "
                        "'llama' draft layers (Qwen3's adds q/k norms)")
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"transformer_layer_config.num_hidden_layers is {layer.get('num_hidden_layers')}; "
                        "tsengine serves one-layer heads")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and len(ids) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids has {len(ids)} ids; tsengine fuses exactly 3")
    if problems:
        raise UserError(f"{where} is a speculators head tsengine cannot serve:\n"
                        + "\n".join(f"  - {p}" for p in problems))
    out = {k: layer[k] for k in _LAYER_KEYS if layer.get(k) is not None}
    out.update(architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1)
    for k in ("draft_vocab_size", "target_hidden_size", "torch_dtype", "dtype"):
        if raw.get(k) is not None:
            out[k] = raw[k]
    if ids is not None:  # layer inputs, as vLLM reads them (from_hf_dict turns them into outputs)
        out["eagle_aux_hidden_state_layer_ids"] = list(ids)
    # vLLM's reading: norm_before_residual true where the key is absent, the other norms false
    flags = {"norm_before_residual": bool(raw.get("norm_before_residual", True)),
             **{k: bool(raw.get(k, False)) for k in FLAGS[1:]}}
    return out, flags


def _vocab_map(raw: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """`d2t`/`t2d` as tsengine keeps them: the EAGLE repository and speculators leave both out where the
    draft vocab is the target's, which is the identity map."""
    if "d2t" in tensors and "t2d" in tensors:
        return tensors
    vocab, draft = raw.get("vocab_size"), raw.get("draft_vocab_size") or raw.get("vocab_size")
    if vocab is None or draft != vocab:
        raise UserError(f"{where}: the weights have no d2t/t2d, but draft_vocab_size ({draft}) differs from "
                        f"vocab_size ({vocab}): a smaller draft vocab needs its map to target ids")
    return {**tensors, "d2t": tensors.get("d2t", torch.zeros(vocab, dtype=torch.long)),
            "t2d": tensors.get("t2d", torch.ones(vocab, dtype=torch.bool))}


def speculators_config(cfg: Eagle3Config, verifier: str, verifier_architectures: list[str],
                       speculative_tokens: int = 3) -> dict[str, Any]:
    """config.json in vLLM's speculators format (what `vllm serve` reads from a `speculators_config`)."""
    rope = dict(cfg.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": cfg.dtype,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],  # layer inputs
        **{k: getattr(cfg, k) for k in FLAGS},
        "torch_dtype": cfg.dtype,
    }


def speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in tensors.items()}
