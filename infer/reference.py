"""The reference speculative generator: batch 1, full recompute every step, obviously correct.

It is the oracle the engine is tested against, so it trades all speed for plainness: no KV cache, one
HF transformers forward over everything each time, trees as Python lists. One verify step:

    draft:  the head reads (token t+1, target features of t) for every committed t, then grows an
            EAGLE-2 dynamic tree (top-k children of the root; each step expands the k best frontier
            nodes by cumulative log-probability; keep the best N-1, parents before children)
    verify: one target forward over [committed tokens + tree nodes], nodes attending only to the
            committed prefix and their ancestors, at position = prefix length + depth
    accept: walk from the root while the target's argmax equals a child; then one bonus token

Invariant (tests/infer/test_reference.py): for any head, output == plain greedy decoding of the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tsengine.config import tree_shape_problems
from tsengine.eagle3.head import Eagle3Head, aux_hidden_states
from tsengine.errors import UserError, fail_if


@dataclass(frozen=True)
class SpecShape:
    """steps S (draft forwards), topk K (children per expansion), num_draft_tokens N (nodes incl. root)."""

    steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def check(self, draft_vocab_size: int | None = None) -> "SpecShape":
        """The engine's shape rules without its limits (lanes, N <= 64, S and K ranges): the oracle must
        also measure shapes the engine refuses."""
        problems = tree_shape_problems(self.steps, self.topk, self.num_draft_tokens,
                                       names=("steps", "topk", "num_draft_tokens"), engine_limits=False,
                                       draft_vocab_size=draft_vocab_size)
        fail_if(problems, "invalid speculative shape")
        return self


@dataclass
class DraftTree:
    """Nodes 0..N-2 below the root: target token ids, parent node (-1 = root) and depth (root = 0)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.depths:
            self.depths = _depths(self.parents)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]


def _depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        assert p < len(depths), "parents must come before their children"
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def prefix_tree_mask(prefix: int, parents: Sequence[int]) -> torch.Tensor:
    """[P+n, P+n] bool: causal over the prefix; node i sees the whole prefix, its ancestors and itself."""
    n = len(parents)
    m = torch.zeros(prefix + n, prefix + n, dtype=torch.bool)
    m[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    m[prefix:, :prefix] = True
    for i, p in enumerate(parents):
        m[prefix + i, prefix + i] = True
        if p >= 0:
            m[prefix + i, prefix:] |= m[prefix + p, prefix:]
    return m


@dataclass
class SpecOutput:
    tokens: list[int]  # generated ids (prompt excluded)
    accept_lengths: list[int]  # tokens committed per verify step, bonus included

    @property
    def tau(self) -> float:
        """Tokens per target verify forward (the prefill's first token is not a verify step)."""
        return (len(self.tokens) - 1) / max(1, len(self.accept_lengths)) if self.accept_lengths else 0.0


Drafter = Callable[[list[int], torch.Tensor], DraftTree]


class ReferenceSpeculator:
    """Target (HF causal LM) + EAGLE-3 head, or any `drafter(tokens, feats) -> DraftTree`."""

    def __init__(self, target, head: Eagle3Head | None, shape: SpecShape = SpecShape(),
                 drafter: Drafter | None = None):
        self.target, self.head, self.drafter = target, head, drafter
        self.shape = shape.check(head.config.draft_vocab_size if head is not None else None)
        if head is not None:
            if head.embed_tokens is None:
                head.bind_embeddings(target.get_input_embeddings().weight)
            self.layer_ids = head.config.aux_layer_ids
        else:
            from tsengine.eagle3.config import default_aux_layer_ids
            self.layer_ids = default_aux_layer_ids(target.config.num_hidden_layers)

    # ---- target ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _target(self, ids: list[int], positions: list[int] | None = None, mask: torch.Tensor | None = None):
        """(logits [T, V] fp32, aux features [T, 3H]) for one sequence; `mask` [T, T] bool or causal."""
        dev = self.target.device
        kw = {}
        if positions is not None:
            kw["position_ids"] = torch.tensor([positions], device=dev)
        if mask is not None:
            kw["attention_mask"] = mask[None, None].to(dev)
        out = self.target(torch.tensor([ids], device=dev), output_hidden_states=True, **kw)
        return out.logits[0].float(), aux_hidden_states(out.hidden_states, self.layer_ids)[0]

    # ---- draft ----------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, tokens: list[int], feats: torch.Tensor) -> DraftTree:
        """EAGLE-2 dynamic tree from the head. `feats[t]` are the target features of tokens[t]."""
        if self.drafter is not None:
            return self.drafter(tokens, feats)
        head, (s, k, n) = self.head, (self.shape.steps, self.shape.topk, self.shape.num_draft_tokens)
        dev = head.lm_head.weight.device
        p = len(tokens) - 1  # draft inputs: (tokens[t+1], feats[t]) for t < p; the last predicts the root's child
        base_ids = torch.tensor(tokens[1:], device=dev)
        base_hidden = head.project(feats.to(dev, head.fc.weight.dtype))
        # candidates: score (cumulative logp), target token, parent candidate (-1 root), depth
        score, token, parent, depth = [], [], [], []
        expanded: list[int] = []  # candidate ids fed to the head, in draft-sequence order
        own_out: dict[int, torch.Tensor] = {-1: None}  # head output at each expanded candidate (-1: root)

        def add_children(par: int, logits: torch.Tensor) -> list[int]:
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(logp, k)  # ties: torch.topk is not order-stable, so re-sort by (-value, id)
            pairs = sorted(zip(top.values.tolist(), top.indices.tolist()), key=lambda vi: (-_rank(vi[0]), vi[1]))
            base = 0.0 if par < 0 else score[par]
            made = []
            for v, d in pairs:
                made.append(len(score))
                score.append(min(base, base + v) if not math.isnan(v) else float("nan"))
                token.append(int(head.to_target(torch.tensor(d, device=dev))))
                parent.append(par)
                depth.append(1 if par < 0 else depth[par] + 1)
            return made

        def run() -> torch.Tensor:
            ids = torch.cat([base_ids, torch.tensor([token[c] for c in expanded], device=dev, dtype=torch.long)])
            hid = [base_hidden] + [own_out[parent[c]][None] for c in expanded]
            positions = list(range(p)) + [p - 1 + depth[c] for c in expanded]
            tree_parents = [expanded.index(parent[c]) if parent[c] >= 0 else -1 for c in expanded]
            mask = prefix_tree_mask(p, tree_parents).to(dev)
            out, logits, _ = head(ids[None], torch.cat(hid)[None], torch.tensor([positions], device=dev),
                                  mask[None, None])
            return out[0], logits[0]

        out, logits = run()
        own_out[-1] = out[p - 1]
        frontier = add_children(-1, logits[p - 1])
        for _ in range(1, s):
            start = len(expanded)
            expanded.extend(frontier)
            out, logits = run()
            new = []
            for j, c in enumerate(expanded[start:], start=start):
                own_out[c] = out[p + j]
                new += add_children(c, logits[p + j])
            frontier = sorted(new, key=lambda c: (-_rank(score[c]), c))[:k]
        keep = sorted(range(len(score)), key=lambda c: (-_rank(score[c]), c))[: n - 1]
        return _dfs_order(keep, score, token, parent)

    # ---- verify ---------------------------------------------------------------------------------
    def verify(self, tokens: list[int], tree: DraftTree):
        """One target forward over prefix + tree. Returns (accepted node ids, bonus token, features of
        the root and the accepted nodes, in order)."""
        n = len(tokens)
        positions = list(range(n)) + [n - 1 + d for d in tree.depths]
        logits, aux = self._target(tokens + tree.tokens, positions, prefix_tree_mask(n, tree.parents))
        node, row, accepted = -1, n - 1, []
        while True:
            pred = int(torch.argmax(logits[row]))  # lowest index on ties
            child = next((c for c in tree.children(node) if tree.tokens[c] == pred), None)
            if child is None:
                break
            accepted.append(child)
            node, row = child, n + child
        rows = [n - 1] + [n + c for c in accepted]
        return accepted, pred, aux[rows]

    # ---- generate -------------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, eos_ids: Sequence[int] = ()) -> SpecOutput:
        if not prompt:
            raise UserError("the prompt is empty: the target needs at least one token to start from")
        eos = set(eos_ids)
        logits, feats = self._target(list(prompt))
        tokens = list(prompt) + [int(torch.argmax(logits[-1]))]
        out, lens = [tokens[-1]], []
        while len(out) < max_new_tokens and out[-1] not in eos:
            tree = self.draft(tokens, feats)
            accepted, bonus, new_feats = self.verify(tokens, tree)
            new = [tree.tokens[c] for c in accepted] + [bonus]
            keep = []
            for t in new:
                keep.append(t)
                if t in eos or len(out) + len(keep) == max_new_tokens:
                    break
            tokens += new
            feats = torch.cat([feats, new_feats.to(feats.dtype)])
            out += keep
            lens.append(len(keep))
        return SpecOutput(out, lens)


def _rank(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def _dfs_order(keep: list[int], score, token, parent) -> DraftTree:
    """Number the kept candidates depth-first, best child first: the likeliest path is 0, 1, 2, ..."""
    kept = set(keep)
    kids: dict[int, list[int]] = {}
    for c in sorted(keep, key=lambda c: (-_rank(score[c]), c)):
        assert parent[c] < 0 or parent[c] in kept, "a kept node's parent must be kept"
        kids.setdefault(parent[c], []).append(c)
    order, new_id, parents = [], {}, []
    stack = list(reversed(kids.get(-1, [])))
    while stack:
        c = stack.pop()
        new_id[c] = len(order)
        order.append(c)
        parents.append(new_id[parent[c]] if parent[c] >= 0 else -1)
        stack.extend(reversed(kids.get(c, [])))
    return DraftTree([token[c] for c in order], parents)


# ---- the plain baseline and the comparison the invariant rests on --------------------------------
@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, eos_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding, full recompute per token (same kernels as the speculator's forwards)."""
    ids, out, eos = list(prompt), [], set(eos_ids)
    while len(out) < max_new_tokens and not (out and out[-1] in eos):
        logits = target(torch.tensor([ids], device=target.device)).logits[0, -1]
        ids.append(int(torch.argmax(logits.float())))
        out.append(ids[-1])
    return out


@dataclass
class Agreement:
    status: str  # "match", "near-tie" or "mismatch"
    position: int | None = None  # first differing generated position
    rel_gap: float | None = None  # (top1 - top2) / |top1| of the target there

    def __str__(self) -> str:
        if self.status == "match":
            return "matched plain greedy decoding token for token"
        return (f"{self.status} at generated position {self.position} "
                f"(target top-2 relative logit gap {self.rel_gap:.2e})")


NEAR_TIE = 1e-4


@torch.no_grad()
def compare_to_greedy(target, prompt: list[int], spec: list[int], greedy: list[int]) -> Agreement:
    """Exact comparison, except a first divergence where the target's top-2 logits are within 1e-4
    (relative) is reported as a near-tie: a float reduction-order effect, not a speculation bug."""
    if spec == greedy:
        return Agreement("match")
    i = next((j for j, (a, b) in enumerate(zip(spec, greedy)) if a != b), min(len(spec), len(greedy)))
    logits = target(torch.tensor([list(prompt) + greedy[:i]], device=target.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    gap = float((top[0] - top[1]) / top[0].abs().clamp_min(1e-12))
    return Agreement("near-tie" if gap < NEAR_TIE else "mismatch", i, gap)
