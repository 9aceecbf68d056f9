"""The built-in prompt collection: size, balance, determinism, and a split that training can rely on.

No model is involved; these run in well under a second, so they stay in the default (not slow) suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from tsengine.train.prompts import CATEGORIES, builtin_prompts, normalize, split, write_jsonl


@pytest.fixture(scope="module")
def prompts():
    return builtin_prompts()


def _text(p: dict) -> str:
    return p["messages"][0]["content"]


def test_size_and_categories(prompts):
    assert len(prompts) >= 1200
    counts = Counter(p["category"] for p in prompts)
    assert set(counts) == set(CATEGORIES) == {"coding", "math", "writing", "explanation", "advice", "reasoning",
                                              "summarization", "chat"}
    assert all(n >= 100 for n in counts.values()), counts


def test_row_shape(prompts):
    for p in prompts:
        assert set(p) == {"id", "category", "messages"}
        assert p["id"].startswith(p["category"] + "-")
        assert p["messages"] == [{"role": "user", "content": _text(p)}]
        assert _text(p).strip() == _text(p) and _text(p)


def test_unique_ids_and_texts(prompts):
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert len({normalize(_text(p)) for p in prompts}) == len(prompts)


def test_deterministic(prompts):
    assert builtin_prompts() == prompts


def test_lengths_suit_a_small_target(prompts):
    words = {p["id"]: len(_text(p).split()) for p in prompts}
    short = [p for p in prompts if p["category"] != "summarization"]
    assert sum(words[p["id"]] < 80 for p in short) >= 0.95 * len(short)
    assert all(words[p["id"]] < 150 for p in prompts if p["category"] == "summarization")


def test_variety_within_categories(prompts):
    # A category dominated by one opening would teach the head a single answer shape.
    for cat in CATEGORIES:
        rows = [_text(p) for p in prompts if p["category"] == cat]
        openings = Counter(" ".join(t.split()[:2]) for t in rows)
        assert len(openings) >= 8, (cat, openings.most_common(3))
        assert openings.most_common(1)[0][1] <= 0.4 * len(rows), (cat, openings.most_common(3))


def test_math_has_numbers_and_summaries_have_passages(prompts):
    for p in prompts:
        if p["category"] == "math":
            assert any(ch.isdigit() for ch in _text(p))
        if p["category"] == "summarization":
            assert len(_text(p).split()) >= 30


def test_split(prompts):
    train, val = split(prompts)
    train_ids, val_ids = {p["id"] for p in train}, {p["id"] for p in val}
    assert not train_ids & val_ids
    assert train_ids | val_ids == {p["id"] for p in prompts}
    assert {p["category"] for p in val} == set(CATEGORIES)
    assert 0.03 <= len(val) / len(prompts) <= 0.08
    # Stable under input order, since it ranks by a hash of the id rather than by position.
    train2, val2 = split(list(reversed(prompts)))
    assert {p["id"] for p in val2} == val_ids


def test_split_rejects_bad_fraction(prompts):
    with pytest.raises(ValueError):
        split(prompts, val_fraction=0.0)


def test_write_jsonl_round_trip(tmp_path, prompts):
    out = tmp_path / "nested" / "prompts"
    train_path, val_path = write_jsonl(out)
    assert (train_path.name, val_path.name) == ("train.jsonl", "val.jsonl")
    rows = {}
    for path in (train_path, val_path):
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        rows[path.name] = [json.loads(line) for line in lines]
    train, val = split(prompts)
    assert rows["train.jsonl"] == train and rows["val.jsonl"] == val
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl", "val.jsonl"]  # no temp files left


def test_cli(tmp_path):
    res = subprocess.run([sys.executable, "-m", "tsengine.train.prompts", "--out", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert "summarization" in res.stdout and "all" in res.stdout
    assert (tmp_path / "train.jsonl").exists() and (tmp_path / "val.jsonl").exists()
