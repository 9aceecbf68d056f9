"""Runs the plan adaptive speculation chooses each step (`policy.py`): the EAGLE-3 proposer
drafts for the requests assigned to it (a chain or a tree), prompt lookup for the others, and the step's
costs and acceptance go back to the policy."""

from __future__ import annotations

import dataclasses
import time

import torch

from tsengine.model import compile_worker
from tsengine.sequence import Backlog
from tsengine.speculative.adaptive.estimates import stats
from tsengine.speculative.adaptive.plan import PAD, Arm, Plan
from tsengine.speculative.adaptive.policy import AdaptivePolicy
from tsengine.speculative.drafts import Committed, Proposal, Proposer

BACKLOG_ROWS = 512  # target-feature rows a request keeps between head drafts (3.5 MB for SmolLM2 in fp32)
IDLE = 0.02  # seconds between steps (beyond the forward) past which the engine was idle, not busy


class AdaptiveProposer(Proposer):
    """The head extends over a request's committed rows when it drafts for it, and keeps their target
    features until then (`Sequence.head_backlog`); with prefix caching, also over its prompt (`_covered_now`).

    Extended every step instead (the first version), its upkeep (a noticeable share of an eager step at 4
    requests) was paid by plain steps too, so the policy had to switch the head off where it did not pay,
    and a request that ran while it was off had a hole in the head's cache and never drafted from it again:
    at 1 request the head went off and on every few dozen to few hundred decisions (off while prompt lookup
    found matches), each switch costing it the rest of the request (traced: docs/benchmarks-journal.md,
    "The head extends lazily: all four levels")."""

    def __init__(self, eagle, ngram, *, steps: int, tree: tuple[int, int, int] | None = None, use_ngram: bool = True,
                 seed: int = 0, prefix_caching: bool = False):
        self.inner, self.ngram, self.prefix_caching = eagle, ngram, prefix_caching
        self.policy = AdaptivePolicy(steps, tree, ngram=use_ngram, seed=seed)
        self._done_at: float | None = None  # when the last step's drafting ended
        self._epoch = -1  # the compile epoch then (`compile_worker.quiet`: did a compile share the step?)

    def adaptive_policy(self) -> AdaptivePolicy:
        return self.policy

    def propose(self, proposal: Proposal):
        policy = self.policy
        policy.learn(proposal, quiet=compile_worker.quiet(self._epoch))
        between = self._between(proposal)
        need = proposal.drafting
        policy.costs.compiled = compile_worker.WORKER.compiled
        t0 = time.perf_counter()
        found = [self.ngram.lookup(seq) for seq in need] if policy.ngram and need else [None] * len(need)
        remaining = [known_remaining(seq) for seq in need]
        kept = [seq.head_backlog.rows if seq.head_backlog is not None else 0 for seq in need]
        plan = (policy.choose([stats(seq, policy.steps) for seq in need], found, remaining, proposal.queued, kept=kept)
                if need else Plan(Arm(0), []))
        t1, epoch = time.perf_counter(), compile_worker.epoch()
        drafts, extended, catch_up = self._head_drafts(proposal, plan)
        for j, source in enumerate(plan.sources):
            if source == "ngram" and found[j] is not None:
                drafts[j] = self.ngram.drafts(found[j], plan.arm.steps)
            elif source == PAD:
                drafts[j] = self.ngram.drafts(need[j].tokens[-1:], plan.arm.steps, source=PAD)
        if need:
            first = next((d for d in drafts if d is not None), None)
            if first is not None:
                first.tokens.sum().item()  # a host sync, on purpose: the drafter's time must be measured
            fresh = not compile_worker.quiet(epoch)  # a compile's time says nothing about the plan's cost
            policy.learn_draft(extended, plan, None if fresh else time.perf_counter() - t1 - catch_up,
                               None if between is None else t1 - t0 + between,
                               graph=self.inner.drafted_in_graph)
            policy.draft_len = plan.arm.steps
            policy.chosen[plan.arm.name] += 1
            policy.drafted_by.update(plan.sources)
        self._done_at, self._epoch = time.perf_counter(), compile_worker.epoch()
        return drafts

    def _between(self, proposal: Proposal) -> float | None:
        """The last step's seconds outside the forward and the drafter: commit, outputs, the server's loop,
        the next schedule. Every step pays them, so a plan that commits more tokens per step saves them
        (through the server, a noticeable share of a one-row step by the difference from in-process runs,
        where plain decoding and prompt lookup ran level: docs/benchmarks-journal.md,
        "Tokens counted by the time they save"). None where unknown or where the gap was the engine idling
        for requests."""
        if self._done_at is None or proposal.target_seconds <= 0:
            return None
        between = time.perf_counter() - self._done_at - proposal.target_seconds
        return between if 0 <= between < IDLE else None

    def _head_drafts(self, proposal: Proposal, plan: Plan) -> tuple[list, int, float]:
        """The head's drafts per drafting request (None where it does not draft), the rows of this step it
        extended over, and the seconds it spent catching up over rows kept from earlier steps. It extends
        over a request's rows only in a step that drafts for it from the head, catching up first over the
        rows kept since (`Backlog`); a step that does not, keeps them, so plain and prompt-lookup steps pay
        no upkeep. A request it cannot extend over (a hole: `head_gap`) never drafts from it."""
        need = proposal.drafting
        heads = {seq for seq, source in zip(need, plan.sources) if source == "eagle3"}
        now, keep = [], []  # extended over this step / kept for a later one (past BACKLOG_ROWS: caught up now)
        for c in proposal.runs:
            backlog = self._backlog(c)
            if backlog is not None:
                full = proposal.aux is None or backlog.rows + len(c.rows) > BACKLOG_ROWS
                (now if c.seq in heads or full or self._covered_now(c) else keep).append(c)
        self._keep(keep, proposal.aux)
        if not now:
            return [None] * len(need), 0, 0.0
        catch_up = self._catch_up(now)
        step = dataclasses.replace(proposal, runs=now)
        flags = [seq in heads for seq in step.drafting]
        arm = plan.arm
        shape = dict(tree=arm.shape) if arm.is_tree else dict(steps=arm.steps if any(flags) else 0)
        got = self.inner.propose(step, only=flags, **shape) or [None] * len(flags)
        by_seq = dict(zip(step.drafting, got))
        return [by_seq.get(seq) for seq in need], sum(len(c.rows) for c in now), catch_up

    def _covered_now(self, c: Committed) -> bool:
        """With prefix caching, the head extends over a prefill chunk's rows at once (with its backlog): a
        prompt block gets its prefix-cache key while the request runs only once the head covers it
        (tsengine/cache/prefix_cache.py), and a request the head never drafted for was otherwise never cached.
        A server whose policy chose plain decoding then ran with no prefix hits at all, at 0.86-0.88x the
        plain server with repeated prompts (docs/benchmarks.md, "Adaptive speculation by default"). Prompt
        blocks so keyed serve concurrent requests as a plain server's do (one extension for all of them). A
        finishing request's rows stay kept: the prefix cache keys its blocks with them pending, and a later
        hit catches up only if it drafts from the head. Caught up at finish (the previous version), every
        finished request paid a head pass over its kept rows, 1.4% of the time at 16 requests, that only a
        next turn of the conversation ever used."""
        return self.prefix_caching and c.start < c.seq.prompt_len

    def _backlog(self, c: Committed) -> Backlog | None:
        """The rows the head has yet to extend over before run `c`, or None where it cannot (a hole: marked
        `head_gap` until it starts afresh). A run starting where the head's KV ends (position 0, a cached
        prefix, a recompute) starts afresh; one after a prefix hit whose head rows the prefix cache kept
        pending goes on from the backlog it handed over."""
        seq, backlog = c.seq, c.seq.head_backlog
        if c.start == seq.draft_cached:
            seq.head_backlog = Backlog(c.start)
        elif backlog is None or (backlog.start, backlog.end) != (seq.draft_cached, c.start):
            seq.head_backlog = None
        stats(seq, self.policy.steps).head_gap = seq.head_backlog is None
        return seq.head_backlog

    @staticmethod
    def _keep(runs: list[Committed], aux) -> None:
        """Each run's target features appended to its request's backlog, in one gather for the step (a
        copy: the step's buffers are reused)."""
        if not runs:
            return
        rows = torch.tensor([r for c in runs for r in c.rows], dtype=torch.long).to(aux.device)
        for c, part in zip(runs, aux[rows].split([len(c.rows) for c in runs])):
            backlog = c.seq.head_backlog
            backlog.parts.append(part)
            backlog.rows += len(c.rows)

    def _catch_up(self, runs: list[Committed]) -> float:
        """Extend over the rows kept for `runs`' requests, in a pass of its own; their backlogs are spent.
        Timed apart (its seconds returned): it is the deferred cost of the steps that kept the rows, and
        priced into this step's plan it made the head look several times dearer than it is step to step
        (traced at 4 requests), and a server stopped choosing a chain that ran faster than plain per step
        (docs/benchmarks-journal.md, "The head extends lazily: all four levels")."""
        behind, parts, at = [], [], 0
        for c in runs:
            backlog, c.seq.head_backlog = c.seq.head_backlog, None
            if backlog.rows:
                behind.append(Committed(seq=c.seq, start=backlog.start, rows=list(range(at, at + backlog.rows)),
                                        drafts_next=False))
                parts += backlog.parts
                at += backlog.rows
        if not behind:
            return 0.0
        t0, epoch = time.perf_counter(), compile_worker.epoch()
        self.inner.propose(Proposal(runs=behind, aux=torch.cat(parts)), steps=0)
        if parts[0].is_cuda:
            torch.cuda.synchronize()  # a host sync, on purpose: the catch-up is timed apart from the plan
        seconds = time.perf_counter() - t0
        # priced into the plan that triggers the next one; not where a compile shared the cores: passes of a
        # few rows timed across one (40-50 ms against 1.5-3) swung the line to 25 ms a row at 4 requests
        if compile_worker.quiet(epoch):
            self.policy.costs.catch_up.update([1.0, at], seconds)
        return seconds


def known_remaining(seq) -> int | None:
    """The tokens `seq` will still generate, where its end is known: EOS and stop ids ignored, it runs to
    max_tokens (a server-side stop string can still end it sooner); else None."""
    p = seq.params
    return p.max_tokens - seq.num_output if p.ignore_eos and not p.stop_token_ids else None
