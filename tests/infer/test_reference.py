"""The oracle's own invariant: speculation never changes greedy output (docs/design/eagle3-head.md)."""

import zlib

import pytest

from tests.helpers.heads import random_head
from tests.helpers.reference import ScriptedDrafter, assert_lossless
from tsengine.errors import UserError
from tsengine.infer.reference import (
    ReferenceSpeculator,
    SpecShape,
    compare_to_greedy,
    greedy_generate,
    prefix_tree_mask,
)
from tsengine.targets import encode_prompt, eos_ids

SHAPES = [SpecShape(3, 1, 4), SpecShape(2, 2, 5), SpecShape(3, 3, 10), SpecShape(4, 4, 16), SpecShape(5, 8, 32)]
PROMPTS = ["write the number of people", "def print ( 1 , 2 )", "how long is the water"]


def _prompt(tok, i):
    return encode_prompt(tok, PROMPTS[i % len(PROMPTS)])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_head_is_lossless(tiny_models, kind, shape):
    model, tok = tiny_models[kind]
    head = random_head(model, seed=7, draft_vocab_size=256)
    for i in range(2):
        prompt = _prompt(tok, i)
        greedy = greedy_generate(model, prompt, 24, eos_ids(model, tok))
        out = ReferenceSpeculator(model, head, shape).generate(prompt, 24, eos_ids(model, tok))
        assert_lossless(model, prompt, out.tokens, greedy)
        assert sum(out.accept_lengths) == len(out.tokens) - 1  # the first token comes from the prefill


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_acceptance_is_exactly_the_matching_path(tiny_models, kind, shape):
    model, tok = tiny_models[kind]
    prompt = _prompt(tok, 1)
    greedy = greedy_generate(model, prompt, 200)  # no EOS stop: the script needs the long continuation
    drafter = ScriptedDrafter(prompt, greedy, shape, model.config.vocab_size, seed=zlib.crc32(str(shape).encode()))
    out = ReferenceSpeculator(model, None, shape, drafter=drafter).generate(prompt, 40)
    assert_lossless(model, prompt, out.tokens, greedy[:40])
    assert out.accept_lengths[:-1] == drafter.expected[:len(out.accept_lengths) - 1]
    assert out.accept_lengths[-1] <= drafter.expected[len(out.accept_lengths) - 1]  # cut at max_new_tokens
    assert max(out.accept_lengths) > 1


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tree_shape_invariants(tiny_models, shape):
    model, tok = tiny_models["llama"]
    spec = ReferenceSpeculator(model, random_head(model, seed=2, draft_vocab_size=256), shape)
    prompt = _prompt(tok, 0)
    _, feats = spec._target(prompt)
    tree = spec.draft(prompt + [5], feats)  # features for every token but the (new) root
    assert len(tree.tokens) == shape.num_draft_tokens - 1
    assert all(p < i for i, p in enumerate(tree.parents)), "parents come before children"
    assert max(tree.depths) <= shape.steps
    # depth-first, best child first: the likeliest path is 0, 1, 2, ... (a chain is parent[i] = i-1)
    first_path = [0]
    while tree.children(first_path[-1]):
        first_path.append(tree.children(first_path[-1])[0])
    assert first_path == list(range(len(first_path)))
    if shape.topk == 1:
        assert tree.parents == list(range(-1, shape.num_draft_tokens - 2))
    for node in range(-1, len(tree.tokens)):  # siblings propose distinct tokens
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(kids) == len(set(kids))


def test_prefix_tree_mask():
    m = prefix_tree_mask(2, [-1, 0, -1, 1])
    assert m.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]


@pytest.mark.parametrize("steps,topk,n,msg", [
    (3, 1, 5, "a chain (topk 1) needs num_draft_tokens = steps + 1 = 4"),
    (2, 2, 8, "exceeds what 2 steps of top-2 can draft"),
    (0, 1, 1, "steps is 0"),
    (3, 0, 4, "topk is 0"),
])
def test_shape_validation(steps, topk, n, msg):
    with pytest.raises(UserError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        SpecShape(steps, topk, n).check()


def test_near_tie_is_reported_not_hidden(tiny_models):
    model, tok = tiny_models["llama"]
    prompt = _prompt(tok, 0)
    greedy = greedy_generate(model, prompt, 8)
    wrong = greedy[:3] + [(greedy[3] + 1) % 300] + greedy[4:]
    verdict = compare_to_greedy(model, prompt, wrong, greedy)
    assert verdict.status == "mismatch" and verdict.position == 3 and verdict.rel_gap > 1e-4
