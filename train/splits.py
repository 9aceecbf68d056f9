"""The rows a run trains and validates on: from the source, subset, turned into answer rows, regenerated
by the target, and written as the prepare stage's input.

Subsets are seeded permutations, not first-N, and regenerated answers are cached by row id, so a larger
limit only adds rows and every cache downstream grows instead of starting over.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tsengine.errors import UserError


def source_splits(r, root: Path) -> tuple[list, list]:
    """(train, val) rows: the built-in collection, or the user's data with a held-out 5% (at least one
    row). Every row gets an `id` (its own, else its index in the file), which names it in later stages.
    `data.max_samples` picks a seeded subset of the source's train rows; target-written prompts
    (`data.synthetic_prompts`) come on top of it, all of them, as many as the user asked for."""
    import hashlib

    from tsengine.conversations import load_rows
    from tsengine.train.regenerate import row_id

    def rows_of(source: str, split: str) -> list:
        return [{**row, "id": row_id(row, i)} for i, row in enumerate(load_rows(source, split))]

    if r.data.source == "builtin":
        from tsengine.train.prompts import synthetic, write_jsonl

        paths = write_jsonl(root / "data" / "prompts")
        train = subset(rows_of(str(paths[0]), "train"), r.data.max_samples, r.seed)
        return synthetic.add_synthetic(train, r, root), rows_of(str(paths[1]), "train")
    from tsengine.train.prompts.synthetic import require_builtin

    require_builtin(r)  # target-written prompts are seeded by the built-in categories
    rows = rows_of(r.data.source, r.data.split)
    if r.data.val_source:
        return subset(rows, r.data.max_samples, r.seed), rows_of(r.data.val_source, r.data.val_split)
    pick = [int(hashlib.sha256(x["id"].encode()).hexdigest()[:8], 16) % 20 == 0 for x in rows]
    if not any(pick) and len(rows) > 1:
        pick[-1] = True
    if len(rows) < 2 or all(pick):
        raise UserError(f"data {r.data.source}: {len(rows)} row(s) cannot be split into train and validation; "
                        "give more rows or data.val_source")
    train = [x for x, p in zip(rows, pick) if not p]
    return subset(train, r.data.max_samples, r.seed), [x for x, p in zip(rows, pick) if p]


def subset(rows: list, limit: int | None, seed: int) -> list:
    """`limit` rows spread over the whole file (seeded), not its first ones: files are often grouped."""
    if limit is None or limit >= len(rows):
        return rows
    import random

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)  # one permutation: a larger limit only adds rows (caches grow)
    keep = sorted(order[:limit])
    return [rows[i] for i in keep]


def answer_rows_for(r, rows: list, split: str) -> list:
    """The prompts as answer rows: several per prompt with regen.samples_per_prompt / include_greedy on
    the train split; validation keeps one answer per prompt (greedy unless only samples are asked for)
    so that val numbers stay comparable across recipes."""
    from tsengine.train.regenerate import answer_rows

    g = r.regen
    if split == "train":
        return answer_rows(rows, g.temperature, g.samples_per_prompt, g.include_greedy)
    return answer_rows(rows, 0.0 if g.include_greedy else g.temperature)


def captures(r) -> bool:
    """Offline features from the engine's own forward: no second target pass."""
    return r.data.regenerate and r.regen.backend == "engine" and r.features.mode == "offline"


def regenerate(r, model, tok, rows: list, out: Path) -> list:
    """The target's answers for `rows`, in their order. Answers are cached by row id across runs: a
    larger max_samples only adds rows; other regeneration settings (or another source) start over."""
    from tsengine.train.regenerate import Regenerator
    from tsengine.train.stages import tokenizer_digest

    # what decides an answer: the engine keys its draws by row id, so its batch size does not count
    settings = {"source": r.data.source, "target": r.target, "tokenizer": tokenizer_digest(tok),
                "max_length": r.data.max_length,
                **(r.regen.cache_fields({"batch_size"}) if r.regen.backend == "engine"
                   else r.regen.model_dump(exclude={"dtype", "batch_size", "base_urls"}) if r.regen.backend == "openai"
                   else r.regen.model_dump(exclude={"dtype", "base_urls", "model"}))}  # HF: the target as loaded
    side = out.with_suffix(".settings.json")
    if side.exists() and json.loads(side.read_text()) != settings:
        out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    side.write_text(json.dumps(settings))
    from tsengine.train.capture import log_wall
    from tsengine.train.data import Skipped

    g, t0, skipped, tokens = r.regen, time.time(), Skipped(), None  # HF's count is not tracked
    if g.backend == "engine":
        from tsengine.targets import resolve
        from tsengine.train.regen_engine import EngineRegenerator

        regen = EngineRegenerator(resolve(r.target), tok, g.batch_size, g.max_new_tokens, g.top_p, g.seed,
                                  r.data.max_length, dtype=g.engine_dtype())
        skipped = regen.run(rows, out)
        tokens = regen.tokens_out
    elif g.backend == "openai":  # the servers' dtype and batching are theirs
        from tsengine.train.regen_openai import OpenAIRegenerator

        regen = OpenAIRegenerator(g.base_urls, g.model, g.batch_size, g.max_new_tokens, g.top_p, g.seed)
        skipped = regen.run(rows, out)
        tokens = regen.tokens_out
    else:  # HF generate samples one temperature per call: one pass per temperature
        for t in sorted({x["temperature"] for x in rows}):
            part = [x for x in rows if x["temperature"] == t]
            skipped.reasons.update(Regenerator(model, tok, g.batch_size, g.max_new_tokens, t, g.top_p, g.seed)
                                   .run(part, out).reasons)
    if skipped.reasons:
        print(f"regenerate: {skipped.summary(len(rows) - sum(skipped.reasons.values()))}")
    log_wall(out.with_suffix(".wall.json"), time.time() - t0, tokens)
    want = {x["id"] for x in rows}
    return [x for x in map(json.loads, out.read_text().splitlines()) if x["id"] in want]


def write_used(rows: list, root: Path, split: str) -> Path:
    """The rows this run trains on as data/used/<split>.jsonl: the input of the prepare stage."""
    used = root / "data" / "used" / f"{split}.jsonl"
    used.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in rows)
    if not used.exists() or used.read_text() != text:  # same bytes keep the prepared data's cache key
        used.write_text(text)
    return used
