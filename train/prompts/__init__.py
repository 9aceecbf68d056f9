"""The project's own prompt collection for distilling a draft head for the embedded default target.

The embedded target is SmolLM2-135M-Instruct. EAGLE-3 heads are best trained on the target's *own*
answers, so what matters is a broad, well-balanced set of user turns to regenerate replies for, not
human-written answers. This collection is written by the project: hand-written topic lists and task
templates in `topics`, numbers and passages drawn by the seeded generators in `procedural`. It copies
nothing from public prompt datasets, so it ships with the code, works offline, and carries no licence
strings of its own.

Everything is derived from a fixed seed, with one RNG per category keyed by the category name, so adding
prompts to one category never renumbers another: ids such as ``math-0042`` stay stable across runs and
machines, which keeps the train/validation split (a hash of the id) stable too.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
from pathlib import Path

from tsengine.train.prompts import procedural
from tsengine.train.prompts import topics as T

SEED = 20240611

# Per-category counts. Coding and math get a little more weight because their answers (code blocks,
# step-by-step arithmetic) are where a 135M target's token distribution is least like plain chat prose.
TARGETS = {
    "coding": 240,
    "math": 220,
    "writing": 200,
    "explanation": 200,
    "advice": 170,
    "reasoning": 200,
    "summarization": 170,
    "chat": 170,
}
CATEGORIES = tuple(TARGETS)


def mix(rng: random.Random, pools: list[list[str]], n: int) -> list[str]:
    """Interleave shuffled pools so every sub-kind is represented even when n is far below the total.

    Sampling the whole template x topic product would let the biggest pool (creative writing, say) crowd
    out the small ones (emails, toasts), and the head's acceptance depends on seeing many kinds of answer.
    """
    pools = [rng.sample(p, len(p)) for p in pools if p]
    out: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(out) < n and any(i < len(p) for p in pools):
        for p in pools:
            if i < len(p) and p[i] not in seen and len(out) < n:
                seen.add(p[i])
                out.append(p[i])
        i += 1
    return out


def _fill(templates, items, **names) -> list[str]:
    """Every template with every item; `names` maps placeholder names to tuple positions in an item."""
    out = []
    for item in items:
        item = item if isinstance(item, tuple) else (item,)
        fields = {k: item[i] for k, i in names.items()} if names else {"x": item[0]}
        out.extend(t.format(**fields) for t in templates)
    return out


def _coding(rng: random.Random, n: int) -> list[str]:
    funcs = _fill(T.FUNCTION_TEMPLATES, [(lang, task) for task in T.FUNCTION_TASKS
                                          for lang in ("Python", "JavaScript")], lang=0, task=1)
    snippets = _fill(T.SNIPPET_TEMPLATES, T.SNIPPETS, lang=0, code=1)
    bugs = _fill(T.BUG_TEMPLATES, T.BUGS, lang=0, goal=1, code=2, symptom=3)
    sql = _fill(T.SQL_TEMPLATES, T.SQL_TASKS, table=0, task=1)
    shell = _fill(T.SHELL_TEMPLATES, T.SHELL_TASKS, task=0)
    # Writing a function is the most common real request, so it takes two slots in the rotation.
    return mix(rng, [funcs[::2], funcs[1::2], snippets, bugs, sql, shell], n)


def _writing(rng: random.Random, n: int) -> list[str]:
    creative = [f.format(s=s) + st for f in T.WRITING_FORMS for s in T.WRITING_SUBJECTS for st in T.WRITING_STYLES]
    return mix(rng, [creative[::2], creative[1::2], _fill(T.PRODUCT_TEMPLATES, T.PRODUCTS),
                     _fill(T.BUSINESS_TEMPLATES, T.BUSINESSES), _fill(T.EMAIL_TEMPLATES, T.EMAILS, r=0, p=1),
                     _fill(T.OCCASION_TEMPLATES, T.OCCASIONS)], n)


def _explanation(rng: random.Random, n: int) -> list[str]:
    single = _fill(T.CONCEPT_TEMPLATES, T.CONCEPTS)
    whys = [q + s for q in T.WHY_QUESTIONS for s in ("", " Explain simply.", " Keep it to a few sentences.")]
    return mix(rng, [single[::2], single[1::2], _fill(T.PAIR_TEMPLATES, T.CONCEPT_PAIRS, a=0, b=1), whys], n)


def _advice(rng: random.Random, n: int) -> list[str]:
    goals = _fill(T.ADVICE_TEMPLATES, T.GOALS)
    return mix(rng, [goals[::2], goals[1::2], _fill(T.SITUATION_TEMPLATES, T.SITUATIONS)], n)


def _chat(rng: random.Random, n: int) -> list[str]:
    events = [f"I just {e}!{f}" for e in T.EVENTS for f in T.EVENT_FOLLOWUPS]
    return mix(rng, [T.SMALL_TALK, _fill(T.JOKE_TEMPLATES, T.JOKE_TOPICS), _fill(T.FAVORITE_TEMPLATES, T.FAVORITES),
                     events, _fill(T.RATHER_TEMPLATES, T.WOULD_YOU_RATHER, a=0, b=1),
                     _fill(T.FACT_TEMPLATES, T.FUN_FACT_TOPICS), _fill(T.RECOMMEND_TEMPLATES, T.RECOMMEND, m=0, x=1),
                     _fill(T.OPINION_TEMPLATES, T.OPINIONS)], n)


_BUILDERS = {
    "coding": _coding,
    "math": procedural.math,
    "writing": _writing,
    "explanation": _explanation,
    "advice": _advice,
    "reasoning": procedural.reasoning,
    "summarization": procedural.summarization,
    "chat": _chat,
}


def normalize(text: str) -> str:
    """Case- and whitespace-insensitive key, so near-identical prompts count once in dedup."""
    return re.sub(r"\s+", " ", text).strip().lower()


def builtin_prompts(seed: int = SEED) -> list[dict]:
    """All prompts as OpenAI-shaped rows; deduplicated across categories so no text is trained twice."""
    seen: set[str] = set()
    out: list[dict] = []
    for cat in CATEGORIES:
        # A string seed goes through SHA-512 in `random.seed`, so this is stable across processes.
        rng = random.Random(f"{seed}:{cat}")
        texts = _BUILDERS[cat](rng, TARGETS[cat])
        k = 0
        for text in texts:
            key = normalize(text)
            if key in seen:
                continue
            seen.add(key)
            out.append({"id": f"{cat}-{k:04d}", "category": cat,
                        "messages": [{"role": "user", "content": text}]})
            k += 1
    return out


def _bucket(prompt_id: str) -> float:
    """Position in [0, 1) from a content hash; Python's hash() is salted per process, so it can't be used."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split(prompts: list[dict], val_fraction: float = 0.05) -> tuple[list[dict], list[dict]]:
    """Stratified, order-independent split: within each category the lowest-hash ids go to validation.

    Ranking by hash (rather than thresholding it) gives every category its exact share, at least one row,
    so validation acceptance can be read per category even for the smaller ones.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    by_cat: dict[str, list[dict]] = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    val_ids: set[str] = set()
    for rows in by_cat.values():
        k = max(1, round(len(rows) * val_fraction)) if len(rows) > 1 else 0
        ranked = sorted(rows, key=lambda p: (_bucket(p["id"]), p["id"]))
        val_ids.update(p["id"] for p in ranked[:k])
    train = [p for p in prompts if p["id"] not in val_ids]
    val = [p for p in prompts if p["id"] in val_ids]
    return train, val


def _write_atomic(path: Path, rows: list[dict]) -> None:
    """Temp file in the same directory, then os.replace, so a reader never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_jsonl(out_dir: str | os.PathLike, val_fraction: float = 0.05) -> tuple[Path, Path]:
    """Materialise the split as train.jsonl / val.jsonl, the shape `tsengine.train.data` already reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, val = split(builtin_prompts(), val_fraction)
    train_path, val_path = out / "train.jsonl", out / "val.jsonl"
    _write_atomic(train_path, train)
    _write_atomic(val_path, val)
    return train_path, val_path


__all__ = ["CATEGORIES", "SEED", "TARGETS", "builtin_prompts", "normalize", "split", "write_jsonl"]
