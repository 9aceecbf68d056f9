"""Target features for training: the three aux hidden states, the final hidden state, the argmax.

Online, the frozen target runs inside the training step. Offline, `train.dump_features` runs it once and
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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

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
            raise UserError(f"features {root}: no readable {INDEX} (run accelerate launch -m train.dump_features)") from None
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
