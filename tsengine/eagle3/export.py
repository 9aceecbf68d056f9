"""Checkpoint -> the interchange format (config.json + model.safetensors) that SGLang, vLLM and tsengine load.

    tsengine export CHECKPOINT --out DIR [--target T] [--dtype bfloat16] [--format sglang|speculators]

CHECKPOINT is a `checkpoints/step-N` directory, a run directory (its latest complete checkpoint) or a head
directory in any format tsengine loads (foreign.py). The head goes through the same validation as a head
being loaded for serving, so an incomplete or mismatched checkpoint is refused with every problem named,
and nothing is written. `--format sglang` (the default) writes what SGLang, SpecForge and vLLM's EAGLE
path read; `--format speculators` what vLLM's speculators path reads (it names the target as verifier).

It lives beside the head format rather than in train/ because `tsengine export` is an engine command and
the engine imports nothing from training; so the checkpoint directory layout a head is read from (the
`step-N` directories, the COMPLETE marker written last) is defined here and the trainer writes to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tsengine.eagle3.config import Eagle3Config
from tsengine.eagle3.format import CONFIG, WEIGHTS, load_head, read_tensors, save_head, save_speculators, validate
from tsengine.eagle3.head import Eagle3Head
from tsengine.errors import UserError

FORMATS = ("sglang", "speculators")
COMPLETE = "COMPLETE"  # written last into a checkpoint: a directory without it is a kill mid-save
NEEDED = (COMPLETE, "head_config.json", "head.safetensors")


def latest_checkpoint(out_root: Path) -> Path | None:
    done = sorted(p for p in out_root.glob("step-*") if (p / COMPLETE).exists())
    return done[-1] if done else None


def find_checkpoint(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"checkpoint {path}: no such directory")
    if (p / "checkpoints").is_dir():
        latest = latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise UserError(f"checkpoint {path}: the run has no complete checkpoint under checkpoints/")
        return latest
    return p


def export_checkpoint(path: str | Path, out: str | Path, target=None, dtype: str | None = None,
                      fmt: str = "sglang", verifier: str | None = None) -> Path:
    """Validate the checkpoint's head (and its fit to `target`, a HF config, if given), then write `out` in
    `fmt`. `verifier`: the target's name or path, which the speculators format records."""
    if fmt not in FORMATS:
        raise UserError(f"format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if fmt == "speculators" and (target is None or verifier is None):
        raise UserError("--format speculators needs --target: the format names the target model it drafts for")
    head = _read(path, target)
    if dtype is not None:
        head.config = head.config.model_copy(update={"dtype": dtype})
    if fmt == "speculators":
        save_speculators(head, out, verifier, list(getattr(target, "architectures", None) or []))
    else:
        save_head(head, out)
    load_head(out, target=target)  # what we wrote is what a server will accept
    return Path(out)


def _read(path: str | Path, target) -> Eagle3Head:
    p = Path(path)
    if (p / CONFIG).exists() and (p / WEIGHTS).exists():  # a head directory, in any format tsengine reads
        return load_head(p, target=target)
    ckpt = find_checkpoint(path)
    missing = [n for n in NEEDED if not (ckpt / n).exists()]
    if missing:
        raise UserError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)} "
                        "(interrupted while saving? use an earlier step)")
    try:
        raw = json.loads((ckpt / "head_config.json").read_text())
    except ValueError as e:
        raise UserError(f"{ckpt / 'head_config.json'} is not valid JSON ({e})") from None
    cfg = Eagle3Config.from_hf_dict(raw, where=str(ckpt / "head_config.json"),
                                    target_num_layers=getattr(target, "num_hidden_layers", None))
    tensors = read_tensors(ckpt, "head.safetensors")
    problems = validate(cfg, tensors, target, where=str(ckpt))
    if problems:
        raise UserError("the checkpoint does not hold an exportable head:\n" + "\n".join(f"  - {p}" for p in problems))
    head = Eagle3Head(cfg)
    head.load_state_dict(tensors, strict=True)
    return head
