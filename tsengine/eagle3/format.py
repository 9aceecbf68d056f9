"""Export, load and validate EAGLE-3 heads in the format SGLang, vLLM and SpecForge exchange.

A head directory holds `config.json` (see config.py) and `model.safetensors` with exactly the keys of
`EXPORT_KEYS` (+ an optional `embed_tokens.weight`, which some public heads carry). Heads the EAGLE
repository and vLLM's `speculators` write load too: their layouts are read into this one first
(foreign.py). Loading validates the whole directory against the target and refuses a mismatch with one
message naming every offending field: a head that loads is a head the engine can run. Weights are read
with safetensors only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tsengine.eagle3 import foreign
from tsengine.eagle3.config import Eagle3Config
from tsengine.eagle3.head import Eagle3Head
from tsengine.errors import UserError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_ATTN = [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
_MLP = [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
_NORMS = [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
EXPORT_KEYS = frozenset(["fc.weight", *_ATTN, *_MLP, *_NORMS, "norm.weight", "lm_head.weight", "d2t", "t2d"])
OPTIONAL_KEYS = frozenset(["embed_tokens.weight"])


def head_keys(cfg: Eagle3Config) -> frozenset[str]:
    """The tensors a head of this config holds: `EXPORT_KEYS`, and the extra norms of speculators' layouts."""
    extra = (["input_norm.weight"] if cfg.norm_before_fc else []) + (
        [f"fc_norm.{i}.weight" for i in range(3)] if cfg.fc_norm else [])
    return EXPORT_KEYS | frozenset(extra)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        **{k: (h,) for k in _NORMS},
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
        "input_norm.weight": (3 * cfg.target_hidden_size,),
        **{f"fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(3)},
    }


def save_head(head: Eagle3Head, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors; each file lands atomically (temp file, then rename)."""
    text = json.dumps(head.config.to_hf_dict(), indent=2) + "\n"  # refuses a layout it cannot say
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = _DTYPES[head.config.dtype]
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in head.exported_state_dict().items()}
    assert set(tensors) == EXPORT_KEYS, sorted(set(tensors) ^ EXPORT_KEYS)
    _atomic(out / WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _atomic(out / CONFIG, lambda p: Path(p).write_text(text))
    return out


def save_speculators(head: Eagle3Head, out_dir: str | Path, verifier: str, verifier_architectures: list[str]) -> Path:
    """The head in vLLM's speculators format (foreign.py): `layers.0.*` tensors, a `speculators_config`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = _DTYPES[head.config.dtype]
    tensors = foreign.speculators_tensors({k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
                                           for k, v in head.exported_state_dict().items()})
    _atomic(out / WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    text = json.dumps(foreign.speculators_config(head.config, verifier, verifier_architectures), indent=2) + "\n"
    _atomic(out / CONFIG, lambda p: Path(p).write_text(text))
    return out


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        os.chmod(tmp, 0o644 & ~umask)  # mkstemp makes it 0600; a head is read by servers under other users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_head(head_dir: str | Path, target_num_layers: int | None = None
              ) -> tuple[Eagle3Config, dict[str, torch.Tensor], str]:
    """The head's config and tensors in tsengine's terms, whichever trainer wrote it, and that format's name
    (foreign.py). `target_num_layers` gives the default aux layers where the head names none."""
    path = Path(head_dir) / CONFIG
    if not Path(head_dir).is_dir():
        raise UserError(f"draft head directory {head_dir} does not exist")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing: a head directory needs {CONFIG} and {WEIGHTS}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} must hold a JSON object")
    raw, flags, tensors, fmt = foreign.normalise(raw, read_tensors(head_dir), where=str(path))
    cfg = Eagle3Config.from_hf_dict(raw, where=str(path), target_num_layers=target_num_layers)
    return (cfg.model_copy(update=flags) if flags else cfg), tensors, fmt


def read_config(head_dir: str | Path, target_num_layers: int | None = None) -> Eagle3Config:
    return read_head(head_dir, target_num_layers)[0]


def read_tensors(head_dir: str | Path, name: str = WEIGHTS) -> dict[str, torch.Tensor]:
    """All tensors of `head_dir/name` (a training checkpoint keeps its head as head.safetensors)."""
    path = Path(head_dir) / name
    if not path.exists():
        if (Path(head_dir) / "pytorch_model.bin").exists():  # the EAGLE repository's checkpoints
            raise UserError(f"{Path(head_dir) / 'pytorch_model.bin'}: tsengine reads weights from safetensors "
                            f"only (a pickle can run code); convert it once, where you trust the file: python -c "
                            f"\"import torch, safetensors.torch as s; s.save_file(torch.load('pytorch_model.bin', "
                            f"weights_only=True), '{WEIGHTS}')\"")
        raise UserError(f"{path} is missing: a head directory needs {CONFIG} and {WEIGHTS}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e})") from None


def validate(cfg: Eagle3Config, tensors: dict[str, torch.Tensor], target: Any | None = None,
             where: str = "head") -> list[str]:
    """Every way this head does not fit its own config or the target (a HF config); [] when it fits."""
    problems = []
    keys, wanted = set(tensors), head_keys(cfg)
    missing, unexpected = wanted - keys, keys - wanted - OPTIONAL_KEYS
    if missing:
        problems.append(f"{WEIGHTS}: missing keys {sorted(missing)}")
    if unexpected:
        problems.append(f"{WEIGHTS}: unexpected keys {sorted(unexpected)} (a 'draft_model.' prefix or "
                        "extra layers are not part of the format)")
    shapes = expected_shapes(cfg)
    float_dtypes = set()
    for k, t in tensors.items():
        if k in shapes and tuple(t.shape) != shapes[k]:
            problems.append(f"{WEIGHTS}: {k} has shape {list(t.shape)}, config.json implies {list(shapes[k])}")
        if k in ("d2t", "t2d"):
            continue
        if t.dtype not in _DTYPES.values():
            problems.append(f"{WEIGHTS}: {k} has dtype {t.dtype}; allowed: float32, bfloat16, float16")
        float_dtypes.add(t.dtype)
    if len(float_dtypes) > 1:
        problems.append(f"{WEIGHTS}: weights mix dtypes {sorted(map(str, float_dtypes))}; use one")
    problems += _check_vocab_map(cfg, tensors.get("d2t"), tensors.get("t2d"))
    if target is not None:
        problems += _check_target(cfg, target, has_embed="embed_tokens.weight" in tensors)
    return [f"{where}: {p}" for p in problems]


def _check_vocab_map(cfg: Eagle3Config, d2t, t2d) -> list[str]:
    problems = []
    if d2t is not None:
        if d2t.dtype != torch.int64:
            problems.append(f"d2t has dtype {d2t.dtype}; expected int64 offsets (target id = i + d2t[i])")
        elif d2t.shape == (cfg.draft_vocab_size,):
            ids = torch.arange(cfg.draft_vocab_size) + d2t
            bad = ((ids < 0) | (ids >= cfg.vocab_size)).nonzero().flatten()
            if len(bad):
                problems.append(f"d2t maps draft ids {bad[:5].tolist()} outside the target vocab "
                                f"0..{cfg.vocab_size - 1}")
            elif len(torch.unique(ids)) != len(ids):
                problems.append("d2t maps two draft ids to the same target id")
            elif t2d is not None and t2d.dtype == torch.bool and t2d.shape == (cfg.vocab_size,):
                if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[ids].all()):
                    problems.append("t2d disagrees with d2t: t2d must be True exactly at the ids d2t maps to")
    if t2d is not None and t2d.dtype != torch.bool:
        problems.append(f"t2d has dtype {t2d.dtype}; expected bool")
    return problems


def _check_target(cfg: Eagle3Config, target: Any, has_embed: bool) -> list[str]:
    problems = []
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size is {cfg.target_hidden_size}, the target's hidden_size is "
                        f"{target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size is {cfg.vocab_size}, the target's vocab_size is {target.vocab_size}")
    if not has_embed and cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size is {cfg.hidden_size} but the head borrows the target's embeddings "
                        f"(hidden_size {target.hidden_size}); ship embed_tokens.weight or match it")
    n = target.num_hidden_layers
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < n]
    if bad:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {list(cfg.aux_layer_ids)}: {bad} not in "
                        f"0..{n - 1} (the target has {n} layers)")
    return problems


def load_head(head_dir: str | Path, target: Any | None = None, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, embeddings: torch.Tensor | None = None) -> Eagle3Head:
    """Validate and load a head. `target`: the target's HF config (checks fit); `embeddings`: the target's
    embedding tensor to share when the file carries none."""
    cfg, tensors, _ = read_head(head_dir, target_num_layers=getattr(target, "num_hidden_layers", None))
    problems = validate(cfg, tensors, target, where=str(head_dir))
    if problems:
        raise UserError("the draft head does not fit:\n" + "\n".join(f"  - {p}" for p in problems))
    dtype = dtype or _DTYPES[cfg.dtype]
    head = Eagle3Head(cfg)
    embed = tensors.pop("embed_tokens.weight", None)
    head.load_state_dict(tensors, strict=True)
    head.place(device, dtype)
    if embed is not None:
        head.bind_embeddings(embed.to(device=device, dtype=dtype))
    elif embeddings is not None:
        head.bind_embeddings(embeddings)
    return head.eval()
