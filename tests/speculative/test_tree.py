"""Tree construction: the batched builder against a plain per-request reference, with ties and NaNs.

Log-probabilities come from an oracle keyed by (request, path of tokens from the root), so both builders
see the same numbers for the same node whatever order they visit it in. Integer logits over a small
vocabulary make ties common (at the top-k boundary, between siblings and between cousins); some entries
are NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from tsengine.speculative.tree import Tree, TreeBuilder, ancestor_bits, ranked_topk

V = 7


def oracle(b: int, path: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((b, *path)) % 2**31)
    lp = torch.log_softmax(torch.randint(0, 3, (V,), generator=g).float(), -1)
    if torch.rand((), generator=g) < 0.2:
        lp[int(torch.randint(0, V, (), generator=g))] = float("nan")
    return lp


def rank(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def reference_tree(b: int, k: int, s: int, n: int):
    """One request, lists and sorted(): returns (tokens, parents, depths) of nodes 0..N-1 (0 = root)."""
    score, token, parent, depth, path = [], [], [], [], []

    def children(par: int) -> list[int]:
        lp = oracle(b, path[par] if par >= 0 else ())
        best = sorted(range(V), key=lambda i: (-rank(float(lp[i])), i))[:k]
        base = 0.0 if par < 0 else score[par]
        made = []
        for i in best:
            v = rank(float(lp[i]))
            made.append(len(score))
            sc = min(base, float(torch.tensor(base) + torch.tensor(v)))  # float32 sums, as the engine's
            score.append(-math.inf if math.isnan(sc) else sc)
            token.append(i)
            parent.append(par)
            depth.append(1 if par < 0 else depth[par] + 1)
            path.append((path[par] if par >= 0 else ()) + (i,))
        return made

    frontier = children(-1)
    for _ in range(1, s):
        new = [c for f in frontier for c in children(f)]
        frontier = sorted(new, key=lambda c: (-score[c], c))[:k]
    keep = sorted(range(len(score)), key=lambda c: (-score[c], c))[: n - 1]
    kids: dict[int, list[int]] = {}
    for c in sorted(keep, key=lambda c: (-score[c], c)):
        assert parent[c] < 0 or parent[c] in keep
        kids.setdefault(parent[c], []).append(c)
    order, node = [], {-1: 0}
    stack = list(reversed(kids.get(-1, [])))
    while stack:
        c = stack.pop()
        order.append(c)
        node[c] = len(order)
        stack.extend(reversed(kids.get(c, [])))
    return ([0] + [token[c] for c in order], [0] + [node[parent[c]] for c in order], [0] + [depth[c] for c in order])


def batched_tree(batch: int, k: int, s: int, n: int) -> Tree:
    tb = TreeBuilder(batch, k, s, n, "cpu")
    paths: list[dict[int, tuple]] = [dict() for _ in range(batch)]

    def path(b: int, c: int) -> tuple:
        if c not in paths[b]:
            p = int(tb.parent[b, c])
            paths[b][c] = (path(b, p) if p >= 0 else ()) + (int(tb.token[b, c]),)
        return paths[b][c]

    tb.root(torch.stack([oracle(b, ()) for b in range(batch)]))
    for _ in range(1, s):
        front = tb.frontier.tolist()
        tb.expand(torch.stack([torch.stack([oracle(b, path(b, c)) for c in front[b]]) for b in range(batch)]))
    tree, _ = tb.finish()
    return tree


@pytest.mark.parametrize("batch, k, s, n", [(3, 1, 3, 4), (2, 2, 3, 8), (4, 3, 4, 12), (2, 4, 2, 6), (3, 2, 5, 9),
                                            (2, 5, 3, 20), (1, 2, 2, 7)])
def test_batched_tree_equals_per_request_reference(batch, k, s, n):
    tree = batched_tree(batch, k, s, n)
    for b in range(batch):
        tokens, parents, depths = reference_tree(b, k, s, n)
        assert tree.tokens[b, 1:].tolist() == tokens[1:], f"request {b}"
        assert tree.parents[b].tolist() == parents, f"request {b}"
        assert tree.depths[b].tolist() == depths, f"request {b}"


def test_tree_shape_invariants():
    """Parents come before children, depth = parent's depth + 1, ancestors are exactly the parent chain,
    and a node's best child is the next node (so the likeliest path is 0, 1, 2, ...)."""
    tree = batched_tree(4, 3, 4, 14)
    for b in range(4):
        par, dep, anc = tree.parents[b].tolist(), tree.depths[b].tolist(), tree.ancestors[b].tolist()
        assert anc[0] == 1 and dep[0] == 0
        for i in range(1, len(par)):
            assert par[i] < i and dep[i] == dep[par[i]] + 1
            assert anc[i] == anc[par[i]] | (1 << i)
        for i in range(len(par)):  # depth-first, best child first: a node's best child is the next node
            kids = [c for c in range(1, len(par)) if par[c] == i]
            assert not kids or kids[0] == i + 1


def test_a_chain_is_the_tree_parent_i_minus_1():
    """topk 1 builds exactly a chain, and it equals Tree.chain's structure."""
    tree = batched_tree(2, 1, 5, 6)
    chain = Tree.chain(2, 6)
    assert torch.equal(tree.parents, chain.parents) and torch.equal(tree.depths, chain.depths)
    assert torch.equal(tree.ancestors, chain.ancestors)


def test_ranked_topk_orders_ties_by_index_and_nan_last():
    x = torch.tensor([[1.0, 3.0, float("nan"), 3.0, 1.0, 3.0], [float("nan")] * 3 + [0.0, 0.0, -1.0]])
    vals, idx = ranked_topk(x, 4)
    assert idx.tolist() == [[1, 3, 5, 0], [3, 4, 5, 0]]
    assert vals[1, 3] == float("-inf")


def test_ancestor_bits_of_a_hand_tree():
    parents = torch.tensor([[0, 0, 1, 0, 3, 3]])
    assert ancestor_bits(parents, 3).tolist() == [[1, 0b11, 0b111, 0b1001, 0b11001, 0b101001]]
