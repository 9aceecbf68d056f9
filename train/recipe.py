"""Typed training recipes: YAML in, one validated object out, or one error naming every bad field.

Strict like SpecForge's config: an unknown key is an error (a typo must never silently train with a
default), every number has a documented range, and `key.sub=value` overrides on the command line go
through the same validation as the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tsengine.errors import UserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Data(_Strict):
    # "builtin": the project's own prompt collection (train/prompts); else a local file/dir or hub dataset
    source: str = "builtin"
    val_source: Optional[str] = None  # None: builtin's validation split, or 5% held out of `source`
    split: str = "train"  # the hub dataset split of `source` (e.g. train_sft for ultrachat_200k)
    val_split: str = "train"  # the hub dataset split of `val_source`
    max_length: int = Field(1024, ge=16, le=131072)
    max_samples: Optional[int] = Field(None, ge=1)  # source train rows used (seeded subset); synthetic ones add to it
    max_val_samples: Optional[int] = Field(None, ge=1)
    regenerate: bool = True  # replace assistant turns with the target's own answers
    # extra training prompts the target writes itself, per built-in category, from seed examples
    # (train/prompts/synthetic.py); deduplicated and filtered; 0 = none
    synthetic_prompts: int = Field(0, ge=0, le=1_000_000)


class Regen(_Strict):
    # engine: tsengine's LLM (continuous batching, chunked prefill; captures features in offline mode);
    # hf: transformers `generate`, for targets the engine does not support; openai: the servers of
    # `base_urls` (vLLM, SGLang, `tsengine serve`) answer, sharing the rows, and a feature pass over the
    # answers follows (train/regen_openai.py)
    backend: Literal["engine", "hf", "openai"] = "engine"
    base_urls: list[str] = []  # openai: e.g. http://10.0.0.5:8000/v1; the key comes from $OPENAI_API_KEY
    model: Optional[str] = None  # openai: the served model name (None: the one the servers list)
    # hf: conversations per generate call; engine: max_num_seqs; openai: requests in flight per server
    batch_size: int = Field(32, ge=1, le=4096)
    max_new_tokens: int = Field(256, ge=1, le=32768)
    temperature: float = Field(0.0, ge=0.0, le=5.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    # answers per prompt drawn at `temperature` (> 0 when above 1), each with its own keyed seed
    samples_per_prompt: int = Field(1, ge=1, le=64)
    include_greedy: bool = False  # also the greedy answer of every prompt (with temperature > 0)
    # the target's dtype while it answers and its features are captured. auto: bfloat16 where the device
    # computes bf16 natively (AMX-bf16 / AVX512-bf16 CPUs, Ampere+ GPUs; tsengine/model/precision.py), else
    # float32. Either way the eval and the engine serve the target in its own dtype.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    @model_validator(mode="after")
    def _servers(self) -> "Regen":
        if self.backend == "openai" and not self.base_urls:
            raise ValueError("regen.backend openai needs regen.base_urls: the OpenAI-compatible servers that answer")
        if self.backend != "openai" and (self.base_urls or self.model):
            raise ValueError(f"regen.base_urls and regen.model are for regen.backend openai (backend is "
                             f"{self.backend!r})")
        bad = [u for u in self.base_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"regen.base_urls {bad}: each must start with http:// or https://")
        return self

    def engine_dtype(self, device: str | None = None) -> str:
        """The dtype the engine answers in on `device` (None: the engine's default device)."""
        if self.dtype != "auto":
            return self.dtype
        from tsengine.model.precision import fast_dtype

        return fast_dtype(device)

    def cache_fields(self, exclude: set[str]) -> dict:
        """The fields that decide an answer, less `exclude`, with the dtype as resolved on this machine (a
        bf16 answer may differ from an fp32 one); fp32 is left out, keeping the keys runs had before the
        field existed."""
        unset = {"base_urls"} | ({"model"} if self.model is None else set())  # keys of runs before they existed
        out, dtype = self.model_dump(exclude=exclude | unset | {"dtype"}), self.engine_dtype()
        return out if dtype == "float32" else {**out, "dtype": dtype}


class Vocab(_Strict):
    draft_vocab_size: int = Field(32000, ge=1, le=1_000_000)


class Head(_Strict):
    aux_layer_ids: Optional[tuple[int, int, int]] = None  # None: EAGLE-3's low/mid/high default
    init_std: float = Field(0.02, gt=0.0, le=1.0)
    fc_init: Literal["scaled", "random"] = "scaled"  # scaled: no target channel starts louder than the median
    lm_head_from_target: bool = False  # lm_head/norm start as the target's read-out (measured: no gain here)


class Features(_Strict):
    mode: Literal["online", "offline"] = "online"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # offline storage dtype
    shard_tokens: int = Field(262144, ge=1024, le=1 << 30)


class Optim(_Strict):
    ttt_steps: int = Field(7, ge=1, le=16)
    step_weight_decay: float = Field(0.8, gt=0.0, le=1.0)  # loss weight of step k is this ** k
    # GRIFFIN's token-alignable training: step k learns only where steps 0..k-1 drafted the target's token
    aligned_steps: bool = False
    lr: float = Field(1e-4, gt=0.0, le=1.0)
    warmup_ratio: float = Field(0.02, ge=0.0, le=1.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    epochs: float = Field(1, gt=0, le=1000)  # a fraction ends within the last epoch (as HF's num_train_epochs)
    max_steps: Optional[int] = Field(None, ge=1)  # optimizer steps; stops early
    batch_tokens: int = Field(8192, ge=16, le=1 << 24)  # padded tokens per micro-batch per rank
    grad_accum: int = Field(1, ge=1, le=1024)
    grad_clip: float = Field(0.5, gt=0.0, le=1e6)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.95)
    loss_chunk_tokens: int = Field(2048, ge=16, le=1 << 24)
    # auto: bf16 autocast where the device computes bf16 natively (GPU; AMX-bf16 / AVX512-bf16 CPUs), else fp32
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    checkpoint_every: int = Field(200, ge=1)
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    eval_every: int = Field(200, ge=1)
    log_every: int = Field(10, ge=1)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        return "no" if v is False else v  # YAML reads a bare `no` (`train.mixed_precision=no`) as false

    def precision(self, device: str | None = None) -> str:
        """accelerate's mixed_precision on `device` ("cpu" or "cuda"; None: the default device), "auto"
        resolved."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        from tsengine.model.precision import bf16_units, default_device

        device = device or default_device()
        return "bf16" if device.startswith("cuda") or bf16_units(device) else "no"


class Log(_Strict):
    report_to: Literal["wandb", "none"] = "wandb"
    project: str = "tsengine"
    run_name: Optional[str] = None


class Eval(_Strict):
    backend: Literal["engine", "reference"] = "engine"  # engine: fast; reference: the slow oracle only
    oracle_prompts: int = Field(2, ge=0)  # engine backend: prompts re-run by the oracle; a mismatch is an error
    num_prompts: int = Field(20, ge=1)
    max_new_tokens: int = Field(128, ge=1, le=32768)
    chain: tuple[int, int, int] = (3, 1, 4)  # steps, topk, num_draft_tokens
    tree: Optional[tuple[int, int, int]] = (5, 8, 32)  # lane rule: (S-1)·K <= N


class Recipe(_Strict):
    target: str
    output_dir: str = "runs/default"
    seed: int = 0
    # minutes the whole run may take, eval included: the data (and epochs) are sized to this machine's
    # measured speeds, and training stops at the plan's deadline (train/budget.py); None: the sizes given
    budget_minutes: Optional[float] = Field(None, gt=0, le=10080)
    data: Data = Data()
    regen: Regen = Regen()
    vocab: Vocab = Vocab()
    head: Head = Head()
    features: Features = Features()
    train: Optim = Optim()
    log: Log = Log()
    eval: Eval = Eval()

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        g = self.regen
        if g.samples_per_prompt > 1 and g.temperature == 0:
            raise ValueError(f"regen.samples_per_prompt={g.samples_per_prompt} needs regen.temperature > 0 "
                             "(greedy decoding has one answer per prompt)")
        if g.include_greedy and g.temperature == 0:
            raise ValueError("regen.include_greedy needs regen.temperature > 0 (the answers are greedy already)")
        from tsengine.config import SpeculativeConfig

        for name, shape in (("eval.chain", self.eval.chain), ("eval.tree", self.eval.tree)):
            if shape is None:
                continue
            s, k, n = shape
            try:  # the engine's own shape rules, one definition
                SpeculativeConfig(num_steps=s, eagle_topk=k, num_draft_tokens=n, draft_model_path="-").checked()
            except UserError as e:
                raise ValueError(f"{name} {list(shape)}: {e}") from None
        return self


def _range_of(model: type[BaseModel], loc: tuple) -> str:
    """'allowed: 1..16' style text from the field's declared bounds, walking nested sections."""
    for i, part in enumerate(loc):
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return ""
        ann = field.annotation
        if i + 1 < len(loc) and isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
            continue
        lo = hi = None
        for m in field.metadata:
            lo = getattr(m, "ge", None) if getattr(m, "ge", None) is not None else lo
            lo = f"> {m.gt}" if getattr(m, "gt", None) is not None else lo
            hi = getattr(m, "le", None) if getattr(m, "le", None) is not None else hi
        if lo is None and hi is None:
            return ""
        left = lo if isinstance(lo, str) else (f">= {lo}" if lo is not None else "")
        right = f"<= {hi}" if hi is not None else ""
        return "allowed: " + " and ".join(x for x in (left, right) if x)
    return ""


def validate(raw: dict[str, Any], where: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if not isinstance(p, int) or len(err["loc"]) == 1)
            name = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                lines.append(f"{name}: unknown key")
                continue
            if err["type"] == "missing":
                lines.append(f"{name}: required")
                continue
            if not err["loc"]:  # a rule across fields: the message names them
                lines.append(err["msg"].removeprefix("Value error, "))
                continue
            allowed = _range_of(Recipe, loc)
            got = err.get("input")
            lines.append(f"{name}={got!r}: {err['msg']}" + (f" ({allowed})" if allowed else ""))
        raise UserError(f"{where}: " + "; ".join(lines)) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`train.lr=3e-4` -> raw['train']['lr'] = 3e-4 (value parsed as YAML, so lists and null work)."""
    if "=" not in item:
        raise UserError(f"override {item!r}: expected key.sub=value")
    key, value = item.split("=", 1)
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise UserError(f"override {item!r}: the value is not valid YAML") from None
    set_key(raw, key.strip(), parsed)


def set_key(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"override {dotted}: {p} is not a section")
    node[parts[-1]] = value


def load(path: str | Path | None, overrides: list[str] = (), **extra: Any) -> Recipe:
    """Recipe file + dotted overrides + explicit keyword values (e.g. output_dir from a CLI flag)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise UserError(f"recipe {path}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise UserError(f"recipe {path}: not valid YAML ({e})") from None
        if not isinstance(raw, dict):
            raise UserError(f"recipe {path}: expected a mapping at the top level")
    for item in overrides:
        apply_override(raw, item)
    for key, value in extra.items():
        if value is not None:
            set_key(raw, key, value)
    return validate(raw, where=str(path or "recipe"))
