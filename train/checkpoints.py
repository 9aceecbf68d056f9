"""Training checkpoints: what a resumed run needs to continue exactly, written so a kill never leaves a
half checkpoint that looks usable.

A checkpoint holds model, optimizer, scheduler, every rank's RNG and the data position (`State`), so a run
killed with -9 and resumed logs the same loss sequence as one that never stopped. It is written into a
temporary directory and renamed when complete; a directory without the COMPLETE marker is never resumed
from. Each also carries the head alone (head.safetensors + head_config.json) for `tsengine export`, which
defines that layout (tsengine/eagle3/export.py): the engine side reads it without importing training.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from tsengine.eagle3.export import COMPLETE, latest_checkpoint


@dataclass
class State:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # micro-batches of this epoch done
    best: float = -1.0
    tokens: int = 0  # trained-on tokens seen (all ranks)
    wall: float = 0.0  # training seconds before this process
    recipe_key: str = ""  # what the run was started with; resuming under another recipe is refused


def save_checkpoint(accelerator, model: nn.Module, state: State, out_root: Path, keep: int) -> Path:
    final = out_root / f"step-{state.step:08d}"
    tmp = out_root / f".step-{state.step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()  # every rank's RNG state is on disk before the marker says complete
    head = accelerator.unwrap_model(model).head
    if accelerator.is_main_process:
        save_file({k: v.detach().cpu().contiguous() for k, v in head.exported_state_dict().items()},
                  str(tmp / "head.safetensors"))
        (tmp / "head_config.json").write_text(json.dumps(head.config.to_hf_dict(), indent=1))
        (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__))
        (tmp / COMPLETE).write_text("")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        done = sorted(p for p in out_root.glob("step-*") if (p / COMPLETE).exists())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, out_root: Path, recipe_key: str) -> State | None:
    """Restore the latest complete checkpoint into the prepared objects; None when there is none. One
    written under other training settings is refused: continuing it would mix two runs in one curve."""
    ckpt = latest_checkpoint(out_root)
    if ckpt is None:
        return None
    saved = State(**json.loads((ckpt / "trainer_state.json").read_text()))
    if saved.recipe_key != recipe_key:
        from tsengine.errors import UserError

        raise UserError(f"{ckpt} was written under other training settings (train.*, seed, data, processes); resume "
                        f"needs the same recipe: use another --output-dir or remove {out_root}")
    accelerator.load_state(str(ckpt))
    return saved
