"""What an EAGLE-3 head is, in numbers, and how that reads and writes as a HF `config.json`.

The on-disk config is a `LlamaConfig` with a few EAGLE-3 fields, because that is what SGLang, vLLM and
SpecForge exchange. Inside tsengine the same facts live in one strict, typed object (`Eagle3Config`):
an unknown field is an error, so a typo never silently falls back to a default.

Aux layer ids use SGLang's meaning: id `i` is the *output* of target decoder layer `i` (0-based), i.e.
the input of layer `i + 1`. vLLM's top-level `eagle_aux_hidden_state_layer_ids` names the layer whose
*input* is captured, so it is written as `i + 1` (see docs/design/eagle3-head.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tsengine.errors import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Low, mid and high features: outputs of layers 1, L/2-1 and L-4 (SGLang's default capture)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


class Eagle3Config(BaseModel):
    """The head's hyper-parameters; `target_*` fields pin it to the target it was made for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: int = Field(gt=0)
    rope_parameters: dict[str, Any]
    vocab_size: int = Field(gt=0, description="target vocabulary size")
    draft_vocab_size: int = Field(gt=0)
    target_hidden_size: int = Field(gt=0)
    aux_layer_ids: tuple[int, int, int]
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Layouts other trainers write (read by tsengine/eagle3/foreign.py); tsengine trains the reference layout,
    # all False, which is the only one the SGLang/SpecForge config format can say (`to_hf_dict`).
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not hidden (speculators' default)
    norm_before_fc: bool = False  # one RMSNorm over the 3 concatenated target features before fc (`input_norm`)
    fc_norm: bool = False  # an RMSNorm per target feature before fc (`fc_norm.0..2`)
    norm_output: bool = False  # speculators' meaning: the state fed to the next draft step is norm(out)

    @property
    def reference_layout(self) -> bool:
        """The EAGLE-3 reference layout (SGLang, SpecForge, the EAGLE repository): no extra norms."""
        return not (self.norm_before_residual or self.norm_before_fc or self.fc_norm or self.norm_output)

    @model_validator(mode="after")
    def _consistent(self) -> "Eagle3Config":
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_key_value_heads})")
        if self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size ({self.draft_vocab_size}) must be <= vocab_size ({self.vocab_size})")
        if any(i < 0 for i in self.aux_layer_ids):
            problems.append(f"aux_layer_ids {list(self.aux_layer_ids)} must be >= 0")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            problems.append(f"rope_parameters.rope_type is {rope_type!r}; allowed: {', '.join(ROPE_TYPES)}")
        if "rope_theta" not in self.rope_parameters:
            problems.append("rope_parameters.rope_theta is missing")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- target side ---------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target: Any, draft_vocab_size: int | None = None,
                   aux_layer_ids: tuple[int, int, int] | None = None, dtype: str = "float32") -> "Eagle3Config":
        """A head shaped like one decoder layer of `target` (a HF config), the EAGLE-3 convention."""
        heads = target.num_attention_heads
        try:
            return cls(
                hidden_size=target.hidden_size,
                intermediate_size=target.intermediate_size,
                num_attention_heads=heads,
                num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
                head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
                rms_norm_eps=target.rms_norm_eps,
                max_position_embeddings=target.max_position_embeddings,
                rope_parameters=_target_rope(target),
                vocab_size=target.vocab_size,
                draft_vocab_size=draft_vocab_size or min(32000, target.vocab_size),
                target_hidden_size=target.hidden_size,
                aux_layer_ids=aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers),
                dtype=dtype,
            )
        except ValidationError as e:
            raise UserError(_describe("draft head", e)) from None

    # ---- HF config.json ------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The SGLang/SpecForge config.json (vLLM reads it too). Only the reference layout: a head with
        speculators' extra norms is written in speculators' format (tsengine/eagle3/foreign.py)."""
        if not self.reference_layout:
            raise UserError("this head uses norms outside the EAGLE-3 reference layout; write it with "
                            "--format speculators")
        rope = dict(self.rope_parameters)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        ids = list(self.aux_layer_ids)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rope_parameters": rope,
            "rope_theta": rope["rope_theta"],
            "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
            "norm_before_residual": False,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json",
                     target_num_layers: int | None = None) -> "Eagle3Config":
        """Read a head config as SGLang/vLLM/SpecForge write it; every problem is named in one error."""
        problems = []
        unknown = sorted(set(d) - _known_hf_keys())
        if unknown:
            problems.append(f"unknown keys {unknown}")
        arch = d.get("architectures") or []
        if not any("Eagle3" in a for a in arch):
            problems.append(f"architectures is {arch}; expected [{ARCHITECTURE!r}]")
        if d.get("num_hidden_layers", 1) != 1:
            problems.append(f"num_hidden_layers is {d.get('num_hidden_layers')}; an EAGLE-3 head has exactly 1")
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act is {d.get('hidden_act')!r}; allowed: 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                problems.append(f"{flag} is true; tsengine supports only false (the EAGLE-3 reference layout)")
        if d.get("norm_output", True) is not True:  # SpecForge's meaning: false drops the norm before lm_head
            problems.append("norm_output is false (no norm before lm_head); tsengine supports only true")
        if (d.get("eagle_config") or {}).get("use_aux_hidden_state", True) is not True:
            problems.append("eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 head); EAGLE-3 heads fuse "
                            "3 target features")
        ids = _aux_ids(d, target_num_layers, problems)
        dtype = str(d.get("torch_dtype") or d.get("dtype") or "float32").replace("torch.", "")
        heads = d.get("num_attention_heads", 0)
        fields = dict(
            hidden_size=d.get("hidden_size"), intermediate_size=d.get("intermediate_size"),
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or ((d.get("hidden_size") or 0) // heads if heads else None),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), max_position_embeddings=d.get("max_position_embeddings", 4096),
            rope_parameters=_rope_from_dict(d), vocab_size=d.get("vocab_size"),
            draft_vocab_size=d.get("draft_vocab_size") or d.get("vocab_size"),
            target_hidden_size=d.get("target_hidden_size") or d.get("hidden_size"),
            aux_layer_ids=ids, dtype=dtype if dtype in DTYPES else "float32",
            norm_before_residual=bool(d.get("norm_before_residual")), fc_norm=bool(d.get("fc_norm")),
            norm_before_fc=bool(d.get("norm_before_fc")),
        )
        if dtype not in DTYPES:
            problems.append(f"torch_dtype is {dtype!r}; allowed: {', '.join(DTYPES)}")
        try:
            cfg = cls(**fields)
        except ValidationError as e:
            problems += _describe_errors(e)
            cfg = None
        if problems:
            raise UserError(f"{where} is not a valid EAGLE-3 head config:\n" + "\n".join(f"  - {p}" for p in problems))
        return cfg


def _describe_errors(e: ValidationError) -> list[str]:
    return [f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()]


def _describe(what: str, e: ValidationError) -> str:
    return f"invalid {what} settings:\n" + "\n".join(f"  - {p}" for p in _describe_errors(e))


def _aux_ids(d: dict, target_num_layers: int | None, problems: list[str]) -> tuple[int, int, int] | None:
    nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    if nested is not None and top is not None and [i + 1 for i in nested] != list(top):
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (layer outputs) disagrees with "
                        f"eagle_aux_hidden_state_layer_ids {top} (layer inputs, expected each id + 1)")
    if nested is not None:
        ids = list(nested)
    elif top is not None:
        ids = [i - 1 for i in top]
    elif target_num_layers is not None:
        ids = list(default_aux_layer_ids(target_num_layers))
    else:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
        return None
    if len(ids) != 3:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids has {len(ids)} ids; EAGLE-3 fuses exactly 3")
        return None
    return tuple(int(i) for i in ids)


def _rope_from_dict(d: dict) -> dict[str, Any]:
    """Newer configs carry `rope_parameters`; older ones `rope_theta` + `rope_scaling`. Accept both."""
    if d.get("rope_parameters"):
        rope = dict(d["rope_parameters"])
    else:
        rope = dict(d.get("rope_scaling") or {})
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    return rope


def _target_rope(target: Any) -> dict[str, Any]:
    rope = getattr(target, "rope_parameters", None)
    if rope:
        return _rope_from_dict({"rope_parameters": dict(rope)})
    return _rope_from_dict({"rope_theta": getattr(target, "rope_theta", 10000.0),
                            "rope_scaling": getattr(target, "rope_scaling", None)})


_KNOWN: set[str] | None = None


def _known_hf_keys() -> set[str]:
    """Keys a Llama-style head config may carry: LlamaConfig's own plus the EAGLE-3 ones."""
    global _KNOWN
    if _KNOWN is None:
        from transformers import LlamaConfig

        _KNOWN = set(LlamaConfig().to_dict()) | {
            "draft_vocab_size", "target_hidden_size", "eagle_config", "eagle_aux_hidden_state_layer_ids",
            "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "rope_theta", "rope_scaling",
            "torch_dtype", "dtype", "architectures",
            "model_type", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
            "tie_word_embeddings", "use_cache", "initializer_range", "pretraining_tp", "attention_dropout",
        }
    return _KNOWN
