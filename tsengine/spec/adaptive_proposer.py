"""Runs the plan adaptive speculation chooses each step (`tsengine/spec/adaptive.py`): the EAGLE-3 proposer
drafts for the requests assigned to it (a chain or a tree), prompt lookup for the others, and the step's
costs and acceptance go back to the policy."""

from __future__ import annotations

import dataclasses
import time

from tsengine import graphs
from tsengine.spec.adaptive import AdaptivePolicy, Arm, Plan, stats
from tsengine.spec.drafts import Proposal

IDLE = 0.02  # seconds between steps (beyond the forward) past which the engine was idle, not busy


class AdaptiveProposer:
    """The head extends over the committed rows of the requests it can draft for, while it is on."""

    def __init__(self, eagle, ngram, steps: int, tree: tuple[int, int, int] | None = None, use_ngram: bool = True,
                 seed: int = 0):
        self.inner, self.ngram = eagle, ngram
        self.policy = AdaptivePolicy(steps, tree, ngram=use_ngram, seed=seed)
        self.draft_len = steps
        self._done_at: float | None = None  # when the last step's drafting ended

    def propose(self, proposal: Proposal):
        policy = self.policy
        policy.learn(proposal)
        between = self._between(proposal)
        head = policy.head_on
        for c in proposal.runs:  # off, the head misses these rows; a run starting where the head's KV ends
            if not head or c.start == c.seq.draft_cached:  # (position 0, or a cached prefix) rebuilds them
                stats(c.seq, policy.steps).head_gap = not head
        need = proposal.drafting
        t0 = time.perf_counter()
        found = [self.ngram.lookup(seq) for seq in need] if policy.ngram and need else [None] * len(need)
        remaining = [known_remaining(seq) for seq in need]
        plan = (policy.choose([stats(seq, policy.steps) for seq in need], found, remaining, proposal.queued) if need
                else Plan(Arm(0), []))
        t1, compiled_before = time.perf_counter(), graphs.compiles()
        drafts, extended = self._head_drafts(proposal, plan)
        for j, source in enumerate(plan.sources):
            if source == "ngram" and found[j] is not None:
                drafts[j] = self.ngram.drafts(found[j], plan.arm.steps)
        if need:
            first = next((d for d in drafts if d is not None), None)
            if first is not None:
                first.tokens.sum().item()  # a host sync, on purpose: the drafter's time must be measured
            fresh = graphs.compiles() != compiled_before
            policy.learn_draft(extended, plan, None if fresh else time.perf_counter() - t1,
                               None if between is None else t1 - t0 + between)
            self.draft_len = plan.arm.steps
            policy.chosen[plan.arm.name] += 1
            policy.drafted_by.update(plan.sources)
        self._done_at = time.perf_counter()
        return drafts

    def _between(self, proposal: Proposal) -> float | None:
        """The last step's seconds outside the forward and the drafter: commit, outputs, the server's loop,
        the next schedule. Every step pays them, so a plan that commits more tokens per step saves them
        (through the server, ~3.5 ms of a ~31 ms one-row step by the difference from in-process runs,
        where plain decoding and prompt lookup ran level). None where unknown or where the gap was the
        engine idling for requests."""
        if self._done_at is None or proposal.target_seconds <= 0:
            return None
        between = time.perf_counter() - self._done_at - proposal.target_seconds
        return between if 0 <= between < IDLE else None

    def _head_drafts(self, proposal: Proposal, plan: Plan) -> tuple[list, int]:
        """The head's drafts per drafting request (None where it does not draft), and the rows it extended
        over. It extends over the requests it can draft for only: one it skipped while off (`head_gap`)
        never can again, and extending over its rows would be upkeep paid for nothing."""
        need = proposal.drafting
        if not self.policy.head_on:  # the choice may have switched it off (the runs were marked before)
            return [None] * len(need), 0
        runs = [c for c in proposal.runs if not stats(c.seq, self.policy.steps).head_gap]
        if not runs:
            return [None] * len(need), 0
        usable = [not seq.spec_stats.head_gap for seq in need]
        only = [e for e, ok in zip(plan.eagle, usable) if ok]
        arm = plan.arm
        shape = dict(tree=arm.shape) if arm.is_tree else dict(steps=arm.steps if any(only) else 0)
        got = iter(self.inner.propose(dataclasses.replace(proposal, runs=runs), only=only, **shape)
                   or [None] * len(only))
        return [next(got) if ok else None for ok in usable], sum(len(c.rows) for c in runs)


def known_remaining(seq) -> int | None:
    """The tokens `seq` will still generate, where its end is known: EOS and stop ids ignored, it runs to
    max_tokens (a server-side stop string can still end it sooner); else None."""
    p = seq.params
    return p.max_tokens - seq.num_output if p.ignore_eos and not p.stop_token_ids else None
