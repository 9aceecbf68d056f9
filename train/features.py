"""Target features for training: the three aux hidden states, the final hidden state, the argmax.

Online, the frozen target runs inside the training step. Offline, `tsengine.train.dump_features` runs it once and
writes sharded safetensors; training then reads the same tensors back. Both paths produce features with
`TargetFeatures`, so offline training equals online training bit for bit when stored in the target's dtype.

We store hidden states, never logits (a 128k vocab would be 30x the bytes): the loss needs the target's
softmax only over the draft vocab, which it recomputes from the final hidden state with the target
lm_head's draft rows. The one full-vocab fact it needs, the argmax (is it in the draft vocab at all?), is
taken here over the full logits, chunked, and stored as one int per token.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tsengine.eagle3.head import aux_hidden_states
from tsengine.errors import UserError


@dataclass
class Features:
    aux: torch.Tensor  # [B, T, 3·H_target]
    final: torch.Tensor  # [B, T, H_target], after the target's final norm
    argmax: torch.Tensor  # [B, T] long, over the full target vocab


def lm_head_weight(model) -> torch.Tensor:
    return model.get_output_embeddings().weight


class TargetFeatures:
    """Runs the frozen target over a right-padded batch and returns its features."""

    def __init__(self, model, layer_ids, chunk: int = 2048):
        self.model, self.layer_ids, self.chunk = model, tuple(layer_ids), chunk

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Features:
        body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        out = body(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        final = out.last_hidden_state
        aux = aux_hidden_states(out.hidden_states, self.layer_ids)
        w = lm_head_weight(self.model)
        flat = final.flatten(0, 1)
        arg = torch.cat([(flat[s:s + self.chunk] @ w.t()).argmax(-1) for s in range(0, flat.shape[0], self.chunk)])
        return Features(aux, final, arg.view(final.shape[:2]))


# ---- offline store --------------------------------------------------------------------------------
INDEX = "index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ShardWriter:
    """Appends examples' features and writes them as one shard once `shard_tokens` have gathered: the
    safetensors file (aux, final, argmax, sequences concatenated) lands atomically, then a sidecar JSON
    naming its examples, offsets, lengths, sha256 and the producing key, plus any per-example `extra`
    fields (captured token ids, masks). A shard without its sidecar does not exist for a reader, so a
    killed writer loses at most the shard in progress."""

    def __init__(self, out: Path, key: str, prefix: str, dtype: str, shard_tokens: int):
        self.out, self.key, self.prefix = Path(out), key, prefix
        self.cast, self.shard_tokens = DTYPES[dtype], shard_tokens
        self.out.mkdir(parents=True, exist_ok=True)
        self.seq = 1 + max([int(p.stem.rsplit("-", 1)[1]) for p in self.out.glob(f"{prefix}-*.json")] or [-1])
        self.pending: list[tuple] = []

    def existing(self) -> list[dict]:
        """Sidecars of finished shards under this key (another key's shards are removed)."""
        return sidecars(self.out, self.key, f"{self.prefix}-*.json")

    def add(self, example, aux: torch.Tensor, final: torch.Tensor, argmax: torch.Tensor, **extra) -> None:
        self.pending.append((example, aux.to(self.cast).cpu(), final.to(self.cast).cpu(), argmax.cpu(), extra))
        if sum(p[1].shape[0] for p in self.pending) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name, p = f"{self.prefix}-{self.seq:05d}", self.pending
        lengths = [x[1].shape[0] for x in p]
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        tensors = {"aux": torch.cat([x[1] for x in p]).contiguous(), "final": torch.cat([x[2] for x in p]).contiguous(),
                   "argmax": torch.cat([x[3] for x in p]).to(torch.int32).contiguous()}
        tmp = self.out / f".{name}.safetensors.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.out / f"{name}.safetensors")
        meta = {"key": self.key, "file": f"{name}.safetensors", "sha256": sha256_file(self.out / f"{name}.safetensors"),
                "examples": [x[0] for x in p], "offsets": offsets, "lengths": lengths}
        for field in p[0][4]:
            meta[field] = [x[4][field] for x in p]
        (self.out / f".{name}.json.tmp").write_text(json.dumps(meta))
        os.replace(self.out / f".{name}.json.tmp", self.out / f"{name}.json")
        self.seq, self.pending = self.seq + 1, []


def sidecars(out: Path, key: str, pattern: str = "shard-*.json") -> list[dict]:
    """Finished shards of this key; leftovers of another key (a stale run) are removed."""
    found = []
    for side in sorted(Path(out).glob(pattern)):
        try:
            meta = json.loads(side.read_text())
        except ValueError:
            meta = None
        shard = side.with_suffix(".safetensors")
        if meta is None or meta.get("key") != key or not shard.exists():
            side.unlink(missing_ok=True)
            shard.unlink(missing_ok=True)
            continue
        found.append(meta)
    return found


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class FeatureStore:
    """Read-only view of a dump: example index -> (aux, final, argmax) for that sequence.

    Each shard's checksum is verified the first time it is opened; a mismatch names the shard."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        try:
            index = json.loads((self.root / INDEX).read_text())
        except (OSError, ValueError):
            raise UserError(f"features {root}: no readable {INDEX} "
                            "(run accelerate launch -m tsengine.train.dump_features)") from None
        self.meta = index
        self.where: dict[int, tuple[str, int, int]] = {}
        self.sha = {}
        for shard in index["shards"]:
            self.sha[shard["file"]] = shard["sha256"]
            for ex, off, n in zip(shard["examples"], shard["offsets"], shard["lengths"]):
                self.where[int(ex)] = (shard["file"], off, n)
        self._open: dict[str, object] = {}

    def __contains__(self, example: int) -> bool:
        return example in self.where

    def _handle(self, name: str):
        if name not in self._open:
            path = self.root / name
            if sha256_file(path) != self.sha[name]:
                raise UserError(f"features {self.root}: shard {name} fails its checksum (re-run dump_features)")
            self._open[name] = safe_open(str(path), framework="pt")
        return self._open[name]

    def get(self, example: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if example not in self.where:
            raise UserError(f"features {self.root}: example {example} is not in the dump")
        name, off, n = self.where[example]
        f = self._handle(name)
        return tuple(f.get_slice(k)[off:off + n] for k in ("aux", "final", "argmax"))  # type: ignore[return-value]

    def batch(self, examples: list[int], length: int, dtype: torch.dtype) -> Features:
        """Right-padded to `length`, as the online path sees a batch."""
        parts = [self.get(e) for e in examples]
        b, h3, h = len(parts), parts[0][0].shape[1], parts[0][1].shape[1]
        aux = torch.zeros(b, length, h3, dtype=dtype)
        final = torch.zeros(b, length, h, dtype=dtype)
        arg = torch.zeros(b, length, dtype=torch.long)
        for i, (a, f, g) in enumerate(parts):
            aux[i, : a.shape[0]], final[i, : f.shape[0]], arg[i, : g.shape[0]] = a.to(dtype), f.to(dtype), g.long()
        return Features(aux, final, arg)
