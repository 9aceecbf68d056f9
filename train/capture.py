"""Stage (offline mode, engine backend): regenerate and capture features in one pass.

    rows -> EngineRegenerator(capture) -> DIR/capture/<split>/shard-*.{safetensors,json}
            (under a multi-process launch each rank takes rows[rank::world] into its own shard-r<rank>-*)
         -> DIR/data/prepared/<split>   (the captured ids and masks, as the prepare stage writes them)
         -> DIR/capture/<split>/index.json (a FeatureStore over the rows this run uses)

The shards are keyed by everything that decides their content (target, tokenizer, regeneration settings,
aux layers, storage dtype, max_length): another key starts over, the same key resumes and a larger
`max_samples` only adds rows. The prepared dataset and the index are rebuilt from the sidecars for the
rows asked for, in their order, so example i of the dataset is example i of the store.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tsengine.train.stages import StageDir, digest, is_done, tokenizer_digest


def capture_split(r, tok, rows: list[dict], split: str, root: Path, layer_ids: tuple[int, ...],
                  progress: bool = True) -> tuple[Path, Path]:
    """Regenerate+capture `rows` (answer rows: ids and temperatures set) where not done; returns
    (prepared dir, feature store dir)."""
    regenerate_share(r, tok, rows, split, root, layer_ids, progress)
    return finalize_split(r, tok, rows, split, root, layer_ids)


def regenerate_share(r, tok, rows: list[dict], split: str, root: Path, layer_ids: tuple[int, ...],
                     progress: bool = True, rank: int = 0, world: int = 1, device: str | None = None) -> None:
    """Regenerate+capture this rank's share of the rows not done yet: rows[rank::world] (fixed by position,
    so ranks never share a row, whatever another rank has finished), into its own shard files. Every rank
    on its own device; rank 0 indexes them all afterwards (`finalize_split`)."""
    from tsengine.targets import resolve
    from tsengine.train.features import ShardWriter, sidecars
    from tsengine.train.regen_engine import CAPTURE_SHARD_TOKENS, EngineRegenerator

    out, key = root / "capture" / split, _key(r, tok, layer_ids)
    writer = ShardWriter(out, key, "shard" if world == 1 else f"shard-r{rank}", r.features.dtype,
                         min(CAPTURE_SHARD_TOKENS, r.features.shard_tokens))
    have = {e for m in sidecars(out, key) for e in m["examples"]}  # any rank's, from any earlier launch
    todo = [x for x in rows[rank::world] if x["id"] not in have]
    if todo:
        g = r.regen
        t0 = time.time()
        regen = EngineRegenerator(resolve(r.target), tok, g.batch_size, g.max_new_tokens, g.top_p, g.seed,
                                  r.data.max_length, layer_ids, dtype=g.engine_dtype(device),
                                  **({"device": device} if device else {}))
        skipped = regen.run(todo, writer=writer, progress=progress)
        if skipped.reasons:
            print(f"regenerate+capture[{split}]: {skipped.summary(len(todo) - sum(skipped.reasons.values()))}")
        name = split if world == 1 else f"{split}.rank{rank}"
        log_wall(root / "data" / "regen" / f"{name}.wall.json", time.time() - t0, regen.tokens_out)


def finalize_split(r, tok, rows: list[dict], split: str, root: Path, layer_ids: tuple[int, ...]) -> tuple[Path, Path]:
    """The prepared dataset and the store index over every rank's shards, for `rows` in their order."""
    from tsengine.train.features import sidecars

    key = _key(r, tok, layer_ids)
    return _finalize(root / "capture" / split, sidecars(root / "capture" / split, key), [x["id"] for x in rows],
                     root, split, key)


def _key(r, tok, layer_ids: tuple[int, ...]) -> str:
    """What decides a row's prompt text and answer; not batch_size (the engine's draws are keyed by row
    id) nor samples_per_prompt/include_greedy (they decide which rows exist, and each keeps its own id)."""
    from tsengine.train.prompts.synthetic import VERSION

    d = r.data
    # a target-written prompt's text depends on its id and the generator's version, not on how many were
    # asked for: N may change without redoing any row (0 keeps the key runs without them always had)
    return digest({"target": r.target, "tokenizer": tokenizer_digest(tok), "seed": r.seed,
                   "data": [d.source, d.split, d.val_source, d.val_split, VERSION if d.synthetic_prompts else 0],
                   "regen": r.regen.cache_fields({"batch_size", "samples_per_prompt", "include_greedy"}),
                   "layers": list(layer_ids), "dtype": r.features.dtype, "max_length": d.max_length})


def log_wall(path: Path, seconds: float, tokens: int | None) -> None:
    """Accumulated over resumed runs: the regenerate stage's wall time and output tokens."""
    prev = json.loads(path.read_text()) if path.exists() else {"wall_s": 0.0, "tokens_out": 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    count = None if tokens is None or prev.get("tokens_out") is None else prev["tokens_out"] + tokens
    path.write_text(json.dumps({"wall_s": round(prev["wall_s"] + seconds, 1), "tokens_out": count}))


def _finalize(out: Path, shards: list[dict], wanted: list[str], root: Path, split: str, key: str) -> tuple[Path, Path]:
    """The prepared dataset and the store index for the wanted rows that were captured (a skipped row
    has no shard entry), plus data/used/<split>.jsonl: the messages, which the eval reads prompts from."""
    import datasets

    from tsengine.train.features import INDEX

    where = {ex: (m, i) for m in shards for i, ex in enumerate(m["examples"])}
    keep = [rid for rid in wanted if rid in where]
    if not keep:
        from tsengine.errors import UserError

        raise UserError(f"data ({split}): none of {len(wanted)} rows could be regenerated and captured "
                        "(the reasons were printed above)")
    prepared = root / "data" / "prepared" / split
    used = root / "data" / "used" / f"{split}.jsonl"
    used.parent.mkdir(parents=True, exist_ok=True)
    used.write_text("".join(json.dumps({"id": rid, "messages": where[rid][0]["messages"][where[rid][1]],
                                        "finished": where[rid][0]["finished"][where[rid][1]]},
                                       ensure_ascii=False) + "\n"
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
            index_shards.append({"file": m["file"], "sha256": m["sha256"],
                                 "examples": [number[m["examples"][i]] for i in pick],
                                 "offsets": [m["offsets"][i] for i in pick],
                                 "lengths": [m["lengths"][i] for i in pick]})
    rows = sum(sum(m["lengths"]) for m in shards)
    size = sum((out / m["file"]).stat().st_size for m in shards)
    index = {"key": pkey, "tokens": sum(sum(s["lengths"]) for s in index_shards), "bytes": size,
             "bytes_per_token": round(size / max(rows, 1), 1), "shards": index_shards, "captured": True}
    # a new file, never written through: the shards (and an index) may be hard links shared with another
    # run (bench/scaling_curve.py); the temp name is this process's own, so no leftover is linked either
    tmp = out / f".{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, out / INDEX)
    return prepared, out
