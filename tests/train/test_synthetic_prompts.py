"""Target-written training prompts (train/prompts/synthetic.py): filters, dedup, stable ids, the cache,
and that they only ever reach the train split. A scripted stand-in for the engine makes the selection
logic exact; the tiny target checks the real engine path is reproducible."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tsengine.errors import UserError
from tsengine.train import recipe as recipes
from tsengine.train.prompts import CATEGORIES, builtin_prompts, split
from tsengine.train.prompts import synthetic as syn


class _Tok:
    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return "\n".join(m["content"] for m in msgs)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1, 2, 3]}


class ScriptedLLM:
    """Answers each request with `write(seed)`: the sampling seed is all an attempt's output depends on."""

    def __init__(self, write):
        self.tokenizer, self.write, self.calls = _Tok(), write, 0

    def generate(self, prompts, params):
        self.calls += 1
        outs = []
        for p in params:
            text = self.write(p.seed)
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=text, token_ids=[0] * 5, finish_reason="stop")]))
        return outs


def _unique(seed):
    return f"Can you explain idea number {seed} to me in simple words?"


BUILTIN = builtin_prompts()[0]["messages"][0]["content"]


def _recipe(target="tiny", n=8, source="builtin", seed=0):
    return recipes.validate({"target": target, "seed": seed, "data": {"synthetic_prompts": n, "source": source}})


def test_every_builtin_prompt_passes_the_filter():
    bad = [(syn.reject_reason(syn.clean(p["messages"][0]["content"])), p["id"]) for p in builtin_prompts()]
    assert [b for b in bad if b[0]] == []


@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("   \n ", "empty"),
    ("Hi?", "too_short"),
    ("Write a poem about the sea<|im_end|>", "template"),
    ("<|im_start|>user\nWrite a poem about cats.", "template"),
    ("Write a story. " * 80, "too_long"),
    ("12 + 34 = 46; 7 * 8 = 56; 9 / 3 = 3 ??", "non_letters"),
    ("这是一个关于天气的问题，请回答?", "non_letters"),
    ("The cat sat on the mat and then the cat sat on the mat and then the cat sat on the mat again?", "repetitive"),
    ("Tell me about the moon. Tell me about the moon. Tell me about the moon.", "repetitive"),
    ("What is this!!!!!!!!!!!!", "repetitive"),
    ("I'm sorry, but I cannot help with that request today.", "refusal"),
    ("As an AI, I don't have personal opinions about music?", "refusal"),
    ("Sure! Here is a short poem about the ocean waves.", "answer"),
    ("Certainly, the capital of France is Paris.", "answer"),
    ("The answer is 42 because six times seven is 42. I hope this helps!", "answer"),
    ("Another one, on a different topic: what is rain?", "echo_instruction"),
    ("Write a new casual chat request about dogs.", "echo_instruction"),
    ("The mitochondria is the powerhouse of the cell and makes energy.", "not_a_request"),
])
def test_filter_drops_crafted_broken_texts(text, reason):
    assert syn.reject_reason(text) == reason


def test_filter_drops_echoes_of_the_examples_and_truncated_text():
    shot = "Write a short poem about a rainy afternoon in the city."
    assert syn.reject_reason("Write a short poem about a rainy afternoon in the city!", [shot]) == "echo_seed"
    assert syn.reject_reason("write a short poem about a rainy afternoon in a city", [shot]) == "echo_seed"
    assert syn.reject_reason("How do I bake sourdough bread at home?", [shot]) is None
    assert syn.reject_reason("How do I bake sourdough bread at", truncated=True) == "truncated"


def test_clean_strips_labels_and_quotes():
    assert syn.clean('  Request: "How do tides work?" ') == "How do tides work?"
    assert syn.clean("5. Explain how tides work.") == "Explain how tides work."
    assert syn.clean("Quick math question: what is 2 + 2?") == "Quick math question: what is 2 + 2?"


def test_attempts_are_keyed_by_seed_and_index_only():
    pool = {c: [f"{c} example {i}?" for i in range(10)] for c in CATEGORIES}
    assert syn.attempt(0, 5, pool) == syn.attempt(0, 5, pool)
    assert syn.attempt(0, 5, pool) != syn.attempt(1, 5, pool)
    assert [syn.attempt(0, k, pool)[0] for k in range(8)] == list(CATEGORIES)
    assert len({syn.attempt(0, k, pool)[2] for k in range(50)}) == 50  # distinct sampling seeds


def test_ids_and_texts_stable_across_runs_and_spread_over_categories():
    a, rep = syn.generate("tiny", 3, 24, llm=ScriptedLLM(_unique), log=lambda *_: None)
    b, _ = syn.generate("tiny", 3, 24, llm=ScriptedLLM(_unique), log=lambda *_: None)
    assert a == b and len(a) == 24 and rep["kept"] == 24
    assert all(r["id"] == f"syn-{r['category']}-{r['id'].rsplit('-', 1)[1]}" for r in a)
    assert {r["category"] for r in a} == set(CATEGORIES)
    c, _ = syn.generate("tiny", 4, 24, llm=ScriptedLLM(_unique), log=lambda *_: None)
    assert [r["messages"] for r in c] != [r["messages"] for r in a]


def test_dedup_against_builtins_and_each_other():
    def write(seed):  # a third copy a built-in (case and punctuation changed), a third repeat one text
        return {0: BUILTIN.upper().rstrip("?.!") + " ...", 1: "How do I keep my houseplants alive?"}.get(
            seed % 3, _unique(seed))

    rows, rep = syn.generate("tiny", 0, 16, llm=ScriptedLLM(write), log=lambda *_: None)
    keys = [syn.dedup_key(r["messages"][0]["content"]) for r in rows]
    builtin_keys = {syn.dedup_key(p["messages"][0]["content"]) for p in builtin_prompts()}
    assert len(keys) == len(set(keys)) == 16
    assert not set(keys) & builtin_keys
    assert rep["dropped"]["duplicate"] > 0
    assert rep["attempts"] > 24  # a second round made up for the drops


def test_junk_is_counted_by_reason_and_short_results_reported():
    lines = []
    rows, rep = syn.generate("tiny", 0, 8, llm=ScriptedLLM(lambda s: "Sure! Here you go."), log=lines.append)
    assert rows == [] and rep["dropped"] == {"answer": rep["attempts"]} and rep["kept_rate"] == 0.0
    assert "only 0 of 8" in lines[0]


def test_only_train_rows_extended_and_cache_reused(tmp_path, monkeypatch):
    from tsengine.train.splits import source_splits as _source_splits

    made = []

    class FakeLLM(ScriptedLLM):
        def __init__(self, target, **kw):
            super().__init__(_unique)
            made.append(target)

    monkeypatch.setattr("tsengine.entrypoints.llm.LLM", FakeLLM)
    train0, val0 = split(builtin_prompts())
    r = _recipe(n=8)
    train, val = _source_splits(r, tmp_path)
    assert [x["id"] for x in val] == [x["id"] for x in val0]
    extra = [x for x in train if x["id"].startswith("syn-")]
    assert len(train) == len(train0) + 8 and len(extra) == 8 and made == ["tiny"]
    assert set(extra[0]) == set(train[0]) and extra[0]["messages"][0]["role"] == "user"
    cache = tmp_path / "data" / "prompts"
    assert json.loads((cache / "synthetic.settings.json").read_text())["n"] == 8
    assert json.loads((cache / "synthetic.report.json").read_text())["kept"] == 8

    again, _ = _source_splits(r, tmp_path)  # unchanged settings: read back, no engine
    assert again == train and made == ["tiny"]
    more, _ = _source_splits(_recipe(n=10), tmp_path)  # changed N: regenerated
    assert made == ["tiny", "tiny"] and len(more) == len(train0) + 10


def test_needs_builtin_source(tmp_path):
    with pytest.raises(UserError, match="data.source builtin"):
        syn.add_synthetic([], _recipe(source=str(tmp_path / "mine.jsonl")), tmp_path)
    assert syn.add_synthetic([{"id": "a"}], _recipe(n=0, source="x.jsonl"), tmp_path) == [{"id": "a"}]


def test_real_engine_reproducible(tiny_dirs, monkeypatch):
    """The tiny target writes noise, so filters are off here: this checks the engine path (chat template,
    keyed seeds, batching) gives the same texts twice and different ones under another seed."""
    from tsengine.entrypoints.llm import LLM

    monkeypatch.setattr(syn, "reject_reason", lambda text, shots=(), truncated=False: None if text else "empty")
    monkeypatch.setattr(syn, "CATEGORIES", ("chat", "advice"))
    monkeypatch.setattr(syn, "SHOTS", 2)
    monkeypatch.setattr(syn, "DEFAULT_MAX_TOKENS", 8)
    runs = [syn.generate("tiny", seed, 6, llm=LLM(str(tiny_dirs["llama"])), log=lambda *_: None)[0]
            for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and len(runs[0]) == 6
    assert [r["messages"] for r in runs[0]] != [r["messages"] for r in runs[2]]


def test_near_duplicates_caught_without_pairwise_diffs():
    near = syn.NearDups()
    near.add("A snail is at the bottom of a 20-foot well. Each day it climbs 3 feet up and sleeps 2 feet down. "
             "How many days will it take for the snail to reach the top of the well?")
    assert near.seen("A snail is at the bottom of a 20-foot well. Each day, it climbs up 3 feet, but at night, it "
                     "slips back 2 feet. How many days will it take for the snail to reach the top?")
    assert not near.seen("How many days does it take a snail to cross a garden that is 20 feet wide?")
    assert not near.seen("Hi there")  # too short to have 5-grams: exact dedup covers it
