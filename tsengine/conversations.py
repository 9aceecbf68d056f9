"""Chat rows as the training data and the evaluation prompts both store them, read into one shape.

Rows come in ShareGPT shape (`conversations: [{from, value}]`) or OpenAI shape (`messages: [{role,
content}]`), from local JSON / JSONL / Parquet through `datasets` (hub names work when online). Training
(tsengine.train.data) and evaluation (tsengine.infer.eval) must agree on what a usable row is, and
evaluation may not import training, so the reading lives here, below both; it needs no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from tsengine.errors import UserError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


def normalize(row: dict[str, Any], require_assistant: bool = True) -> list[dict[str, str]]:
    """Either shape -> [{role, content}]; raises ValueError(reason) for a malformed row. A prompt row
    (`require_assistant=False`) may stop before the reply; regeneration appends one."""
    if row.get("messages") is not None:
        raw, keys = row["messages"], ("role", "content")
    elif row.get("conversations") is not None:
        raw, keys = row["conversations"], ("from", "value")
    else:
        raise ValueError("no messages/conversations")
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ValueError("turns are not a list of objects")
    turns = [(m.get(keys[0]), m.get(keys[1])) for m in raw]
    if not turns:
        raise ValueError("no turns")
    out = []
    for role, content in turns:
        if role not in ROLES:
            raise ValueError("unknown role")
        if not isinstance(content, str) or not content.strip():
            raise ValueError("empty content")
        out.append({"role": ROLES[role], "content": content})
    if require_assistant and not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn")
    if not any(m["role"] == "user" for m in out):
        raise ValueError("no user turn")
    return out


def load_rows(source: str, split: str = "train") -> Iterable[dict[str, Any]]:
    """Local .json/.jsonl/.parquet (or a directory of them) through `datasets`; else a hub dataset name
    (`split` picks its split: ultrachat_200k calls it train_sft)."""
    try:
        return _load_rows(source, split)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable files, empty files, unknown splits
        raise UserError(f"data {source}: cannot load ({type(e).__name__}: {e})") from None


def _load_rows(source: str, split: str) -> Iterable[dict[str, Any]]:
    import datasets

    path = Path(source)
    kinds = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
    if path.exists():
        files = sorted(p for p in path.iterdir() if p.suffix in kinds) if path.is_dir() else [path]
        if not files or path.suffix not in kinds and not path.is_dir():
            raise UserError(f"data {source}: expected .json, .jsonl or .parquet files")
        builder = kinds[files[0].suffix]
        if all(f.stat().st_size == 0 for f in files):
            raise UserError(f"data {source}: empty")
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    if source.count("/") == 1 and not source.startswith((".", "/")):
        return datasets.load_dataset(source, split=split)
    raise UserError(f"data {source}: no such file or directory (nor a hub dataset name org/name)")
