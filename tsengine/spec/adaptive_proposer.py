"""Runs the plan adaptive speculation chooses each step (`tsengine/spec/adaptive.py`): the EAGLE-3 proposer
drafts for the requests assigned to it (a chain or a tree), prompt lookup for the others, and the step's
costs and acceptance go back to the policy."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from tsengine import graphs
from tsengine.spec.adaptive import AdaptivePolicy, Arm, Plan, stats
from tsengine.spec.drafts import Committed, Proposal

BACKLOG_ROWS = 512  # target-feature rows a request keeps while the head is off (3.5 MB for SmolLM2 in fp32)
IDLE = 0.02  # seconds between steps (beyond the forward) past which the engine was idle, not busy


class AdaptiveProposer:
    """The head extends over the committed rows of the requests it can draft for while it is on; off, it
    keeps their target features and catches up over them when it is on again (`Backlog`)."""

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
        over. Off, it keeps each run's target features instead (`_defer`); on, it extends over a request's
        kept rows with its new ones, in one batched pass. A request it cannot extend over (`head_gap`) never
        drafts from it, and its rows are not extended over: that would be upkeep paid for nothing."""
        need = proposal.drafting
        if not self.policy.head_on:  # (the choice may have just switched it off)
            self._defer(proposal)
            return [None] * len(need), 0
        proposal = self._caught_up(proposal)
        if not proposal.runs:
            return [None] * len(need), 0
        usable = [not seq.spec_stats.head_gap for seq in need]
        only = [e for e, ok in zip(plan.eagle, usable) if ok]
        arm = plan.arm
        shape = dict(tree=arm.shape) if arm.is_tree else dict(steps=arm.steps if any(only) else 0)
        got = iter(self.inner.propose(proposal, only=only, **shape) or [None] * len(only))
        for c in proposal.runs:  # extended: nothing is kept any more
            c.seq.spec_stats.backlog = None
        return [next(got) if ok else None for ok in usable], sum(len(c.rows) for c in proposal.runs)

    def _backlog(self, c: Committed) -> Backlog | None:
        """The rows the head has yet to extend over before run `c`, or None where it cannot (a hole: marked
        `head_gap` for good). A run starting where the head's KV ends (position 0, a cached prefix, a
        recompute) starts afresh."""
        st, seq = stats(c.seq, self.policy.steps), c.seq
        if c.start == seq.draft_cached:
            st.head_gap, st.backlog = False, Backlog(c.start)
        elif st.head_gap or st.backlog is None or (st.backlog.start, st.backlog.end) != (seq.draft_cached, c.start):
            st.head_gap, st.backlog = True, None
        return st.backlog

    def _defer(self, proposal: Proposal) -> None:
        """Head off: keep each run's target features (a copy: the step's buffers are reused), up to
        `BACKLOG_ROWS` a request; past that, or after a hole, the request is given up (`head_gap`)."""
        for c in proposal.runs:
            backlog = self._backlog(c)
            if backlog is None:
                continue
            if backlog.rows + len(c.rows) > BACKLOG_ROWS or proposal.aux is None:
                c.seq.spec_stats.head_gap, c.seq.spec_stats.backlog = True, None
                continue
            rows = torch.tensor(c.rows, dtype=torch.long).to(proposal.aux.device)
            backlog.parts.append(proposal.aux[rows])
            backlog.rows += len(c.rows)

    def _caught_up(self, proposal: Proposal) -> Proposal:
        """The runs the head extends over this step, each with the rows it kept for it while it was off
        before its own (their features appended to the step's), and without the requests it gave up."""
        runs, parts, at = [], [proposal.aux], proposal.aux.shape[0] if proposal.aux is not None else 0
        for c in proposal.runs:
            backlog = self._backlog(c)
            if backlog is None:
                continue
            if backlog.rows:
                kept = list(range(at, at + backlog.rows))
                parts += backlog.parts
                at += backlog.rows
                c = dataclasses.replace(c, start=backlog.start, rows=kept + c.rows)
            runs.append(c)
        aux = torch.cat(parts) if len(parts) > 1 else proposal.aux
        return dataclasses.replace(proposal, runs=runs, aux=aux)


@dataclass
class Backlog:
    """Target features of positions [start, start + rows) the head has not extended over, kept while it is
    off: on again, it catches up in one pass and drafts for the request at once. Without them, a request
    that ran while it was off could never draft from it, so each switch (at one request, ~100 decisions
    apart while prompt lookup found matches, measured) cost the head for the rest of that request."""

    start: int
    parts: list = field(default_factory=list)  # [rows, A] tensors of target features, in position order
    rows: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows


def known_remaining(seq) -> int | None:
    """The tokens `seq` will still generate, where its end is known: EOS and stop ids ignored, it runs to
    max_tokens (a server-side stop string can still end it sooner); else None."""
    p = seq.params
    return p.max_tokens - seq.num_output if p.ignore_eos and not p.stop_token_ids else None
