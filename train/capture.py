"""Stage (offline mode, engine backend): regenerate and capture features in one pass.

    rows -> EngineRegenerator(capture) -> DIR/capture/<split>/shard-*.{safetensors,json}
         -> DIR/data/prepared/<split>   (the captured ids and masks, as the prepare stage writes them)
         -> DIR/capture/<split>/index.json (a FeatureStore over the rows this run uses)

The shards are keyed by everything that decides their content (target, tokenizer, regeneration settings,
aux layers, storage dtype, max_length): another key starts over, the same key resumes and a larger
`max_samples` only adds rows. The prepared dataset and the index are rebuilt from the sidecars for the
rows asked for, in their order, so example i of the dataset is example i of the store.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from train.stages import StageDir, digest, is_done, tokenizer_digest


def capture_split(r, tok, rows: list[dict], split: str, root: Path, layer_ids: tuple[int, ...],
                  progress: bool = True) -> tuple[Path, Path]:
    """Regenerate+capture `rows` (answer rows: ids and temperatures set) where not done; returns
    (prepared dir, feature store dir)."""
    from train.features import ShardWriter
    from train.regen_engine import CAPTURE_SHARD_TOKENS, EngineRegenerator
    from tsengine.targets import resolve

    out = root / "capture" / split
    settings = {"target": r.target, "tokenizer": tokenizer_digest(tok), "source": r.data.source,
                "regen": r.regen.model_dump(exclude={"batch_size"}), "layers": list(layer_ids),
                "dtype": r.features.dtype, "max_length": r.data.max_length}
    key = digest(settings)
    writer = ShardWriter(out, key, "shard", r.features.dtype, min(CAPTURE_SHARD_TOKENS, r.features.shard_tokens))
    have = {e for m in writer.existing() for e in m["examples"]}
    todo = [x for x in rows if x["id"] not in have]
    if todo:
        g = r.regen
        t0 = time.time()
        regen = EngineRegenerator(resolve(r.target), tok, g.batch_size, g.max_new_tokens, g.top_p, g.seed,
                                  r.data.max_length, layer_ids)
        skipped = regen.run(todo, writer=writer, progress=progress)
        if skipped.reasons:
            print(f"regenerate+capture[{split}]: {skipped.summary(len(todo) - sum(skipped.reasons.values()))}")
        _log_wall(root / "data" / "regen" / f"{split}.wall.json", time.time() - t0, regen.tokens_out)
    return _finalize(out, writer.existing(), [x["id"] for x in rows], root, split, key)


def _log_wall(path: Path, seconds: float, tokens: int) -> None:
    """Accumulated over resumed runs: the regenerate stage's wall time and output tokens."""
    prev = json.loads(path.read_text()) if path.exists() else {"wall_s": 0.0, "tokens_out": 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"wall_s": round(prev["wall_s"] + seconds, 1),
                                "tokens_out": prev.get("tokens_out", 0) + tokens}))


def _finalize(out: Path, shards: list[dict], wanted: list[str], root: Path, split: str, key: str) -> tuple[Path, Path]:
    """The prepared dataset and the store index for the wanted rows that were captured (a skipped row
    has no shard entry), plus data/used/<split>.jsonl: the messages, which the eval reads prompts from."""
    import datasets

    from train.features import INDEX

    where = {ex: (m, i) for m in shards for i, ex in enumerate(m["examples"])}
    keep = [rid for rid in wanted if rid in where]
    prepared = root / "data" / "prepared" / split
    used = root / "data" / "used" / f"{split}.jsonl"
    used.parent.mkdir(parents=True, exist_ok=True)
    used.write_text("".join(json.dumps({"id": rid, "messages": where[rid][0]["messages"][where[rid][1]],
                                        "finished": where[rid][0]["finished"][where[rid][1]]}, ensure_ascii=False) + "\n"
                            for rid in keep))
    pkey = digest(key, keep)
    if not is_done(prepared, pkey):
        ids = [where[rid][0]["input_ids"][where[rid][1]] for rid in keep]
        masks = [where[rid][0]["loss_mask"][where[rid][1]] for rid in keep]
        info = {"source": str(used), "rows": len(keep), "tokens": sum(map(len, ids)),
                "loss_tokens": sum(map(sum, masks)), "skipped": {"not captured": len(wanted) - len(keep)},
                "captured": True}
        with StageDir(prepared, pkey, info) as tmp:
            datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(tmp / "data"))
    number = {rid: n for n, rid in enumerate(keep)}
    index_shards = []
    for m in shards:
        pick = [i for i, ex in enumerate(m["examples"]) if ex in number]
        if pick:
            index_shards.append({"file": m["file"], "sha256": m["sha256"], "examples": [number[m["examples"][i]] for i in pick],
                                 "offsets": [m["offsets"][i] for i in pick], "lengths": [m["lengths"][i] for i in pick]})
    rows = sum(sum(m["lengths"]) for m in shards)
    size = sum((out / m["file"]).stat().st_size for m in shards)
    index = {"key": pkey, "tokens": sum(sum(s["lengths"]) for s in index_shards), "bytes": size,
             "bytes_per_token": round(size / max(rows, 1), 1), "shards": index_shards, "captured": True}
    (out / INDEX).write_text(json.dumps(index))
    return prepared, out
