"""The draft vocabulary: which target tokens the head can propose, as `d2t` / `t2d`.

A head predicts over N draft ids; draft id i stands for target id `i + d2t[i]` (the offset form SGLang
and vLLM load), and `t2d[t]` says whether target id t is in the draft vocab. Draft ids are the chosen
target ids in ascending order, so offsets are >= 0 and the map is monotone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tsengine.errors import UserError


def vocab_map(vocab_size: int, draft_vocab_size: int, counts: torch.Tensor | None = None):
    """The `draft_vocab_size` most frequent ids (ties: lower id), padded with unseen ids when fewer
    were seen; without counts, the first N ids. Returns (d2t int64 [N], t2d bool [vocab])."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise UserError(f"draft vocab size {draft_vocab_size} must be in 1..{vocab_size} (the target vocab)")
    if counts is None:
        chosen = torch.arange(draft_vocab_size)
    else:
        counts = counts.to(torch.float64)
        # stable sort on -count keeps lower ids first among equal counts; unseen ids (count 0) pad the tail
        order = torch.sort(-counts, stable=True).indices
        chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.long), t2d


def read_token_counts(path: str | Path, vocab_size: int) -> torch.Tensor:
    """A JSON object {token_id: count} (ids as strings or ints) or a list of `vocab_size` counts."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"token counts file {path}: cannot read JSON ({e})") from None
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    if isinstance(raw, list):
        if len(raw) != vocab_size:
            raise UserError(f"token counts file {path}: list has {len(raw)} entries, the target vocab is {vocab_size}")
        return torch.tensor(raw, dtype=torch.float64)
    if not isinstance(raw, dict):
        raise UserError(f"token counts file {path}: expected an object {{token_id: count}} or a list of counts")
    for k, v in raw.items():
        try:
            i = int(k)
        except ValueError:
            raise UserError(f"token counts file {path}: key {k!r} is not a token id") from None
        if not 0 <= i < vocab_size:
            raise UserError(f"token counts file {path}: token id {i} is outside 0..{vocab_size - 1}")
        counts[i] = float(v)
    return counts
