"""The reference generator as the oracle: losslessness checks and scripted drafters."""

from __future__ import annotations

import random

import pytest

from tsengine.infer.reference import DraftTree, compare_to_greedy


def assert_lossless(model, prompt, spec_tokens, greedy):
    verdict = compare_to_greedy(model, prompt, spec_tokens, greedy)
    if verdict.status == "near-tie":
        pytest.skip(f"reported near-tie, not a failure: {verdict}")  # visible in -ra output, never silent
    assert verdict.status == "match", str(verdict)


class ScriptedDrafter:
    """Proposes random trees in which the true greedy continuation runs exactly `depth` levels deep.

    Acceptance is then known in advance: `depth` nodes + the bonus. If tree masks, positions or the
    acceptance walk were wrong, either the accept counts or the output would differ.
    """

    def __init__(self, prompt, greedy, shape, vocab, seed):
        self.prompt, self.greedy, self.shape, self.vocab = prompt, greedy, shape, vocab
        self.rng = random.Random(seed)
        self.expected: list[int] = []

    def __call__(self, tokens, feats):
        assert feats.shape[0] == len(tokens) - 1  # features for every committed token but the root
        n = self.shape.num_draft_tokens - 1
        parents = [-1]
        for i in range(1, n):  # random tree, parents before children, depth <= steps
            parents.append(self.rng.choice([-1] + [j for j in range(i) if _depth(parents, j) < self.shape.steps]))
        tree = DraftTree([0] * n, parents)
        j = len(tokens) - len(self.prompt)  # greedy[j] is the token after the root
        truth = self.greedy[j:] + [None] * 64
        target_node = self.rng.randrange(n)
        path = _path(parents, target_node)
        depth = self.rng.randint(0, len(path))
        on_path = {node: d for d, node in enumerate(path, start=1)}
        for i in range(n):
            d = tree.depths[i]
            if i in on_path and on_path[i] <= depth:
                tree.tokens[i] = truth[d - 1]
            else:
                tree.tokens[i] = self.rng.choice([t for t in range(self.vocab) if t != truth[d - 1]])
        self.expected.append(depth + 1)
        return tree


def _depth(parents, j):
    d = 1
    while parents[j] >= 0:
        j, d = parents[j], d + 1
    return d


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
