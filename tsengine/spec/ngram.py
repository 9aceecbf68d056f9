"""NGRAM drafting (prompt lookup): propose the tokens that followed the latest earlier occurrence of the
request's own last n tokens. No model, no training: the baseline every benchmark compares against.

It runs on the host by nature (a search over a Python token list, as vLLM's n-gram proposer does), once
per request per step, after the commit has put the new tokens on the host anyway. Longest n first
(`prompt_lookup_max` down to `prompt_lookup_min`), latest occurrence first. No match: no drafts, and the
request decodes one plain token next step rather than verifying guesses it has no reason to make.
"""

from __future__ import annotations

import torch

from tsengine.spec.drafts import Drafts, Proposal


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


class NgramProposer:
    def __init__(self, num_steps: int, n_min: int, n_max: int, device):
        self.steps, self.n_min, self.n_max, self.device = num_steps, n_min, n_max, device

    def propose(self, proposal: Proposal) -> list[Drafts | None]:
        """A chain of `steps` target ids per request (padded by repeating the last proposal), or None."""
        out = []
        for seq in proposal.drafting:
            found = propose(seq.tokens, self.steps, self.n_min, self.n_max)
            if found is None:
                out.append(None)
                continue
            found = found + [found[-1]] * (self.steps - len(found))
            out.append(Drafts(torch.tensor(found, dtype=torch.long).to(self.device, non_blocking=True)))
        return out
