"""EAGLE-2 dynamic draft trees, built for a whole batch at once with no host sync.

The rule (the same as `infer/reference.py`, which is the oracle in tests/speculative/test_tree.py):
  step 0      the K best children of the root;
  step s ≥ 1  expand the K best candidates made at step s-1 (by cumulative log-probability), K children
              each, so K + (S-1)·K² candidates in all;
  keep        the best N-1 candidates.
Ranking is total and deterministic: score descending, then candidate id ascending (ids are creation order:
the root's children, then step by step, parent by parent, child rank by child rank). NaN ranks last. A
child's score is clamped to its parent's, so a kept child's parent is always kept.

Numbering: the verify window is node 0 (the root: the last committed token) then the kept candidates
depth-first, best child first. The likeliest path is 0, 1, 2, …, and a chain is the tree parent[i] = i-1.
The depth-first order is a sort by a path key: each depth contributes (sibling rank + 1) as one digit in
base K+1, so a parent sorts before its subtree and subtrees come in sibling order.

While drafting, the frontier's K nodes per step sit in "lanes" of the draft cache: lane (s-1)·K + j
holds the j-th node fed at step s. A node sees the committed prefix, its ancestors' lanes and its own, as
a bitmask; (S-1)·K ≤ N keeps the lanes inside the window the target verifies next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ranked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last dim, ordered by (value descending, index ascending); NaN ranks last.
    torch.topk alone is not order-stable on ties, and ties decide which node a tree keeps."""
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    n = x.shape[-1]
    kth = x.topk(k, dim=-1).values[..., -1:]
    above, equal = x > kth, x == kth
    take = above | (equal & (equal.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # lowest ids among ties
    idx = (take * torch.arange(n, 0, -1, device=x.device)).topk(k, dim=-1).indices  # the k taken, id ascending
    vals = x.gather(-1, idx)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), idx.gather(-1, order)


@dataclass
class Tree:
    """A batch of verify windows of N nodes each (node 0 = root). [B, N] tensors; the root's token is a
    placeholder (the engine puts the last committed token there)."""

    tokens: torch.Tensor  # draft-vocab ids (as given to TreeBuilder) of each node
    parents: torch.Tensor  # parent node (the root's parent is 0, itself)
    depths: torch.Tensor  # 0 for the root
    ancestors: torch.Tensor  # int64 bitmask: bit j set when node j is the node itself or one of its ancestors

    @staticmethod
    def chain(batch: int, n: int, device=None) -> "Tree":
        ar = torch.arange(n, device=device)
        parents = (ar - 1).clamp(min=0)
        anc = (torch.ones(n, dtype=torch.long, device=device) << (ar + 1)) - 1  # bits 0..i
        return Tree(torch.zeros(batch, n, dtype=torch.long, device=device), parents.expand(batch, n).clone(),
                    ar.expand(batch, n).clone(), anc.expand(batch, n).clone())


def ancestor_bits(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N] parents (parents before children) -> [B, N] int64 bitmasks of self + ancestors."""
    own = torch.ones_like(parents) << torch.arange(parents.shape[-1], device=parents.device)
    anc = own
    for _ in range(max_depth):  # each pass reaches one level further up; depth ≤ max_depth
        anc = own | anc.gather(-1, parents)
    return anc


class TreeBuilder:
    """Feed it log-probabilities step by step (`root`, then `expand` S-1 times), then `finish`.

    Between calls the drafter runs its head on `frontier_tokens()` with hidden states from their parents
    (`expand` returns which of the nodes just fed is each new frontier node's parent), in the step's lanes
    with the visibility bitmask `frontier_lane_bits()`."""

    def __init__(self, batch: int, topk: int, steps: int, num_nodes: int, device):
        self.b, self.k, self.s, self.n, self.device = batch, topk, steps, num_nodes, device
        c = topk + (steps - 1) * topk * topk
        self.score = torch.empty(batch, c, device=device)
        self.token = torch.empty(batch, c, dtype=torch.long, device=device)
        self.parent = torch.full((batch, c), -1, dtype=torch.long, device=device)
        self.key = torch.zeros(batch, c, dtype=torch.long, device=device)
        self.depth = torch.cat([torch.ones(topk, dtype=torch.long)] +
                               [torch.full((topk * topk,), s + 1, dtype=torch.long)
                                for s in range(1, steps)]).to(device)
        self.made = 0  # candidates so far
        self.frontier = None  # [B, K] candidate ids to feed next
        self.lane_bits = torch.zeros(batch, topk, dtype=torch.long, device=device)  # of the frontier's parents
        self.step = 0

    def _digit(self, depth: int) -> int:
        return (self.k + 1) ** (self.s - depth)

    def root(self, logp: torch.Tensor) -> None:
        """logp [B, V]: the root's children."""
        vals, ids = ranked_topk(logp.float(), self.k)
        k = self.k
        self.score[:, :k], self.token[:, :k] = vals.clamp(max=0.0), ids  # the clamp to the root's score 0
        self.key[:, :k] = (torch.arange(k, device=self.device) + 1) * self._digit(1)
        self.made, self.frontier, self.step = k, torch.arange(k, device=self.device).expand(self.b, k), 1

    def frontier_tokens(self) -> torch.Tensor:
        return self.token.gather(1, self.frontier)

    def frontier_lane_bits(self) -> torch.Tensor:
        """[B, K] what each node fed at this step sees among the lanes: its ancestors' lanes and its own."""
        lanes = (self.step - 1) * self.k + torch.arange(self.k, device=self.device)
        return self.lane_bits | (torch.ones_like(lanes) << lanes)

    def expand(self, logp: torch.Tensor) -> torch.Tensor:
        """logp [B, K, V] of the K frontier nodes just fed. Returns [B, K]: for each node of the new
        frontier, which of the nodes just fed (0..K-1) is its parent (the drafter gathers their outputs)."""
        b, k, s = self.b, self.k, self.step
        vals, ids = ranked_topk(logp.float(), k)  # [B, K, K]
        fed_bits = self.frontier_lane_bits()
        par_score = self.score.gather(1, self.frontier)
        score = torch.minimum(par_score[..., None], par_score[..., None] + vals)
        score = torch.where(torch.isnan(score), torch.full_like(score, float("-inf")), score)
        lo, hi = self.made, self.made + k * k
        self.score[:, lo:hi], self.token[:, lo:hi] = score.flatten(1), ids.flatten(1)
        self.parent[:, lo:hi] = self.frontier[..., None].expand(b, k, k).flatten(1)
        rank = torch.arange(k, device=self.device) + 1
        self.key[:, lo:hi] = (self.key.gather(1, self.frontier)[..., None] + rank * self._digit(s + 1)).flatten(1)
        _, best = ranked_topk(self.score[:, lo:hi], k)  # ties: the lower candidate id
        self.frontier, self.made, self.step = best + lo, hi, s + 1
        fed = best // k  # which fed node is the parent
        self.lane_bits = fed_bits.gather(1, fed)
        return fed

    def finish(self) -> tuple[Tree, torch.Tensor]:
        """(Tree with N nodes, [B, N-1] candidate id of each drafted node)."""
        b, n = self.b, self.n
        _, keep = ranked_topk(self.score[:, :self.made], n - 1)
        keep = keep.gather(1, self.key.gather(1, keep).argsort(dim=1))  # depth-first: by path key
        node_of = torch.zeros(b, self.made + 1, dtype=torch.long, device=self.device)  # candidate -> node
        node_of.scatter_(1, keep, torch.arange(1, n, device=self.device).expand(b, n - 1))
        par = self.parent.gather(1, keep)
        parents = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=self.device),
                             node_of.gather(1, torch.where(par < 0, self.made, par))], dim=1)  # root: column made -> 0
        depths = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=self.device), self.depth[keep]], dim=1)
        tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=self.device), self.token.gather(1, keep)], dim=1)
        return Tree(tokens, parents, depths, ancestor_bits(parents, self.s)), keep
