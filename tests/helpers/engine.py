"""The engine on a tiny target: LLMs, workloads, greedy truths, and a proposer that rewrites drafts."""

from __future__ import annotations

import random

from tsengine.entrypoints.llm import LLM
from tsengine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 2, 9, 100, 41, 7, 8, 9, 10], [7, 8, 9], list(range(40, 75)), [300, 12] * 9]


def make_llm(tiny_dirs, kind="llama", head=None, steps=3, **kw):
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    spec = {"method": "eagle3", "model": str(head),
            "adaptive": False, "num_speculative_tokens": steps} if head else None
    return LLM(str(tiny_dirs[kind]), speculative_config=spec, **kw)


def first_drafts(llm, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Run one greedy request until its first output token: (its tokens then, the drafts made from them)."""
    from tsengine.sampling_params import SamplingParams

    e = llm.engine
    e.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while not e.requests["r"].num_output:
        e.step()
    seq = e.requests["r"]
    return list(seq.tokens), seq.drafts.tokens.tolist()


def random_workload(engine, prompts, params, seed: int, abort_rate: float):
    """Requests arrive at random (half the steps) and are aborted at random (`abort_rate` per step) until
    the engine is idle. Returns (tokens per request index, aborted indices, whether any was preempted)."""
    rng, pending = random.Random(seed), list(range(len(prompts)))
    got: dict[int, list[int]] = {i: [] for i in pending}
    aborted, preempted = set(), False
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.5:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        if rng.random() < abort_rate and engine.requests:
            victim = rng.choice(sorted(engine.requests))
            engine.abort(victim)
            aborted.add(int(victim))
        for o in engine.step():
            got[int(o.request_id)] += o.new_tokens
        preempted |= any(s.num_preempted for s in engine.scheduler.running + list(engine.scheduler.waiting))
    return got, aborted, preempted


def greedy_truth(tiny_dirs, kind, n):
    """Plain greedy (no speculation) continuations of PROMPTS, `n` tokens each, keyed by prompt."""
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = make_llm(tiny_dirs, kind).generate(PROMPTS, sp)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


class DraftRewriter:
    """Stands in for an engine's proposer: the real proposer drafts (so its caches and tree shapes stay
    real), then `rewrite(seqs, drafts)` replaces the drafts of the requests that got any."""

    def __init__(self, engine):
        self.engine, self.inner = engine, engine.proposer
        engine.proposer = self

    def propose(self, proposal):
        out = self.inner.propose(proposal)
        got = [(s, d) for s, d in zip(proposal.drafting, out) if d is not None]
        if not got:
            return out
        new = iter(self.rewrite([s for s, _ in got], [d for _, d in got]))
        return [None if d is None else next(new) for d in out]

    def adaptive_policy(self):
        return self.inner.adaptive_policy()

    def rewrite(self, seqs: list, drafts: list) -> list:
        raise NotImplementedError
