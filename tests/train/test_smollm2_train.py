"""The real pipeline on the embedded SmolLM2, demo-sized (slow: a few minutes). `make test-all` runs it."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.reference import assert_lossless
from tsengine.eagle3.format import load_head
from tsengine.infer.reference import ReferenceSpeculator, SpecShape, greedy_generate
from tsengine.targets import encode_prompt, eos_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.real_model
def test_demo_sized_recipe_learns_and_exports_a_lossless_head(smollm2, tmp_path):
    from tsengine.train.demo import DEMO_OVERRIDES, RECIPE
    from tsengine.train.train_eagle3 import main

    assert main(["--recipe", str(RECIPE), "--output-dir", str(tmp_path), *DEMO_OVERRIDES]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] * 0.8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval"]["3,1,4"]["tau"] > 1.0  # a random head accepts nothing (tau exactly 1.00); this one does
    _, model, tok = smollm2
    head = load_head(tmp_path / "export", target=model.config, embeddings=model.get_input_embeddings().weight)
    prompt = encode_prompt(tok, "Give me three tips for writing clear emails.")
    greedy = greedy_generate(model, prompt, 32, eos_ids(model, tok))
    out = ReferenceSpeculator(model, head, SpecShape(3, 1, 4)).generate(prompt, 32, eos_ids(model, tok))
    assert_lossless(model, prompt, out.tokens, greedy)
    print(f"demo-sized head: tau {summary['eval']}", file=sys.stderr)
