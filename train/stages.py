"""Cached pipeline stages: each output directory records the key of the inputs that made it.

A stage is redone when its key changes (different data, tokenizer, sizes) and skipped when it matches,
so the pipeline (`train/pipeline.py`) can run "whatever is not done yet" and never reuse a stale product. Outputs
land in a temporary sibling directory first and are renamed into place, so a killed stage leaves no half product
that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

MARKER = "stage.json"


def digest(*parts: Any) -> str:
    """sha256 over JSON-able parts; a Path contributes its file bytes (or a directory's stage key)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path):
            if p.is_dir():
                h.update(json.dumps(read_marker(p)).encode())
            else:
                with p.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def tokenizer_digest(tok) -> str:
    """What decides token ids and masks: the vocab/merges and the chat template."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # padding/truncation state changes as the tokenizer is used: not part of its identity
        body = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
    else:
        body = tok.get_vocab()
    return digest(body, getattr(tok, "chat_template", None) or "")


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_done(path: Path, key: str) -> bool:
    m = read_marker(path)
    return m is not None and m.get("key") == key


class StageDir:
    """`with StageDir(out, key) as tmp:` write into tmp; on success tmp replaces `out` with a marker."""

    def __init__(self, out: Path, key: str, info: dict[str, Any] | None = None):
        self.out, self.key, self.info = Path(out), key, dict(info or {})
        self.tmp = self.out.with_name(self.out.name + ".tmp")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.t0 = time.time()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        self.info.update(key=self.key, wall_s=round(time.time() - self.t0, 2))
        (self.tmp / MARKER).write_text(json.dumps(self.info, indent=1))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
