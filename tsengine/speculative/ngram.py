"""NGRAM drafting (prompt lookup): propose the tokens that followed the latest earlier occurrence of the
request's own last n tokens. No model, no training: the baseline every benchmark compares against.

It runs on the host by nature, once per request per step, after the commit has put the new tokens on the
host anyway. Longest n first (`prompt_lookup_max` down to `prompt_lookup_min`), latest occurrence that has
a continuation first. No match: no drafts, and the request decodes one plain token next step rather than
verifying guesses it has no reason to make.

`propose` is the rule written as a search (the oracle); `NgramIndex` answers the same question from a
dict of every n-gram's latest start, updated by the tokens each step appends, because the search costs
O(context) per request per step, which at long contexts and many requests is a large share of a step.
"""

from __future__ import annotations

import torch

from tsengine.speculative.drafts import Drafts, Proposal, Proposer


def propose(tokens: list[int], steps: int, n_min: int, n_max: int) -> list[int] | None:
    """Up to `steps` tokens continuing the latest earlier match of the longest suffix n-gram, or None."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):  # latest occurrence that has a continuation
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + steps]
                if follow:
                    return follow
    return None


class NgramIndex:
    """The latest start of every n-gram (n_min..n_max) that has a continuation, for one growing token list."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.latest: dict[tuple[int, ...], int] = {}
        self.seen = 0  # tokens[:seen] are indexed

    def update(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last call (a request's tokens only ever grow)."""
        for end in range(max(self.seen, 1), len(tokens)):  # tokens[end] continues the n-grams ending at end-1
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.latest[tuple(tokens[end - n:end])] = end - n
        self.seen = len(tokens)

    def lookup(self, tokens: list[int], steps: int) -> list[int] | None:
        """`propose(tokens, steps, n_min, n_max)`, answered from the index."""
        self.update(tokens)
        size = len(tokens)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            start = self.latest.get(tuple(tokens[size - n:]))
            if start is not None:
                return tokens[start + n:start + n + steps]
        return None


class NgramProposer(Proposer):
    def __init__(self, num_steps: int, n_min: int, n_max: int, device):
        self.steps, self.n_min, self.n_max, self.device = num_steps, n_min, n_max, device

    def lookup(self, seq) -> list[int] | None:
        """Up to `steps` continuation tokens for `seq`, from its own index (kept on the request)."""
        if seq.ngram is None:
            seq.ngram = NgramIndex(self.n_min, self.n_max)
        return seq.ngram.lookup(seq.tokens, self.steps)

    def drafts(self, found: list[int], steps: int, source: str = "ngram") -> Drafts:
        """A chain of exactly `steps` drafts: the continuation cut or padded by repeating its last token."""
        found = found[:steps] + [found[-1]] * (steps - len(found))
        return Drafts(torch.tensor(found, dtype=torch.long).to(self.device, non_blocking=True), source=source)

    def propose(self, proposal: Proposal) -> list[Drafts | None]:
        """A chain of `steps` target ids per request, or None where nothing matches."""
        return [None if (found := self.lookup(seq)) is None else self.drafts(found, self.steps)
                for seq in proposal.drafting]
