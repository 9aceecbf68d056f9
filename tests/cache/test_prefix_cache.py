"""Prefix caching (tsengine/cache/prefix_cache.py): outputs with the cache equal outputs without it, the draft
cache of a hit is what recomputing would give (and a key without the token after the block is caught),
n > 1 samples prefill once, and block accounting stays exact under preemption and aborts."""

from __future__ import annotations

import argparse

import httpx
import pytest
import torch

from tests.helpers.engine import random_workload
from tests.helpers.server import serving
from tsengine.cache import prefix_cache
from tsengine.cache.kv_cache import BlockManager
from tsengine.config import EngineConfig
from tsengine.engine.core import Engine
from tsengine.entrypoints.engine_args import add_engine_args, engine_config
from tsengine.entrypoints.llm import LLM
from tsengine.sampling_params import SamplingParams
from tsengine.sequence import Backlog, Sequence

SYSTEM = list(range(100, 123))  # a 23-token "system prompt": 5 full blocks of 4 and a partial one
FIRST_TURN = [SYSTEM + [5, 6, 7], SYSTEM + [8, 9], SYSTEM + [5, 6, 7, 1, 2, 3, 4, 5], [7, 8, 9]]


def spec_for(method: str, head) -> dict | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec = {"method": "eagle3", "adaptive": False, "model": str(head), "num_speculative_tokens": 3}
    return spec | ({"eagle_topk": 2, "num_draft_tokens": 6} if method == "tree" else {})


def llm(tiny_dirs, method, head, caching: bool, **kw) -> LLM:
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    return LLM(str(tiny_dirs["llama"]), speculative_config=spec_for(method, head), enable_prefix_caching=caching, **kw)


def params(i: int, n: int = 1, max_tokens: int = 10) -> SamplingParams:
    """Greedy and seeded sampled rows, alternating."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return SamplingParams(temperature=0.9, seed=40 + i, max_tokens=max_tokens, ignore_eos=True, n=n)


def conversation(engine_llm: LLM) -> list[list[int]]:
    """Two turns that resend the history, then n = 3 samples of one prompt; every output in order."""
    first = engine_llm.generate(FIRST_TURN, [params(i) for i in range(len(FIRST_TURN))])
    outs = [o.outputs[0].token_ids for o in first]
    second = [p + out + [11, 12, 13] for p, out in zip(FIRST_TURN, outs)]
    outs += [o.outputs[0].token_ids for o in engine_llm.generate(second, [params(i) for i in range(len(second))])]
    many = engine_llm.generate([SYSTEM + [42, 43, 44, 45, 46]], params(1, n=3))[0]
    return outs + [o.token_ids for o in many.outputs]


@pytest.mark.parametrize("method", ["plain", "chain", "tree", "ngram"])
def test_outputs_equal_without_the_cache(tiny_dirs, heads, method):
    on = llm(tiny_dirs, method, heads["llama"], True)
    got = conversation(on)
    assert got == conversation(llm(tiny_dirs, method, heads["llama"], False))
    prefix = on.engine.scheduler.prefix
    assert prefix.hits > 0.3 * prefix.queries, (prefix.hits, prefix.queries)  # the cache did serve most of it


def test_off_means_no_cache(tiny_dirs):
    off = llm(tiny_dirs, "plain", None, False)
    assert off.engine.scheduler.prefix is None
    off.generate([SYSTEM + [1], SYSTEM + [2]], params(0))
    assert not off.engine.runner.blocks.key_of


def draft_kv_after_prefill(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `prompt` until its prefill is committed (target and head); return the draft cache's K and the
    target's layer-0 K at its positions [0, len - 1) (what a later step reads)."""
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.requests["probe"]
    while seq.draft_cached < len(prompt):
        engine.step()
    bs = engine.runner.block_size
    slots = torch.tensor([seq.table[p // bs] * bs + p % bs for p in range(len(prompt) - 1)])
    draft_k = engine.runner.draft_kv[0].flatten(0, 1)[slots].clone()
    target_k = engine.runner.kv[0][0].flatten(0, 1)[slots].clone()
    engine.abort("probe")
    return draft_k, target_k


def stale_draft_slots(tiny_dirs, heads) -> float:
    """Largest difference between the draft KV of a request served from the cache and computed afresh.
    The cached request A and the probe B share a 16-token (4-block) prefix and differ right after it, so
    B may reuse A's first 3 blocks and the 4th's target KV, but not the 4th's last draft slot."""
    shared = SYSTEM[:16]
    a, b = shared + [1, 2, 3, 4, 5, 6], shared + [9, 8, 7, 6, 5, 4]
    cached = llm(tiny_dirs, "chain", heads["llama"], True).engine
    cached.add_request("a", a, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while cached.has_unfinished():
        cached.step()
    got_draft, got_target = draft_kv_after_prefill(cached, b)
    assert cached.scheduler.prefix.hits >= 12  # it did start from the cache
    want_draft, want_target = draft_kv_after_prefill(llm(tiny_dirs, "chain", heads["llama"], False).engine, b)
    torch.testing.assert_close(got_target, want_target, rtol=1e-4, atol=1e-5)
    return (got_draft - want_draft).abs().max().item()


def test_hit_blocks_hold_the_draft_kv_recomputing_would(tiny_dirs, heads):
    assert stale_draft_slots(tiny_dirs, heads) < 1e-4


def test_key_without_next_token_is_caught(tiny_dirs, heads, monkeypatch):
    """The mutation the key design guards against: drop the token after the block from the key, and the
    test above sees the stale last draft slot."""
    real = prefix_cache.block_key
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens, next_token: real(parent, tokens, -1))
    assert stale_draft_slots(tiny_dirs, heads) > 1e-2


def prefill_tokens(engine: Engine) -> list[int]:
    """Record the prompt tokens each step forwards (prefill chunks, not decode/verify windows)."""
    seen, real = [], engine.scheduler.schedule

    def schedule(only=None):
        batch = real(only)
        seen.extend(s.num_tokens for s in batch if not s.verify and not s.seq.decoding)
        return batch
    engine.scheduler.schedule = schedule
    return seen


@pytest.mark.parametrize("method, max_tokens", [("plain", 10), ("chain", 10), ("chain", 1)])
def test_n_samples_prefill_their_prompt_once(tiny_dirs, heads, method, max_tokens):
    """max_tokens 1: sample 0 finishes in its prefill step; the head still extends over it before its blocks
    go back, so they are complete and cached."""
    prompt = SYSTEM + [60, 61, 62, 63, 64, 65, 66, 67, 68]  # 32 tokens: 7 full blocks + 3 to compute
    on = llm(tiny_dirs, method, heads["llama"], True)
    seen = prefill_tokens(on.engine)
    got = on.generate([prompt], params(1, n=4, max_tokens=max_tokens))[0]
    assert sum(seen) == len(prompt) + 3 * (len(prompt) - 28), seen  # sample 0 whole, the others past 7 blocks
    off = llm(tiny_dirs, method, heads["llama"], False).generate([prompt], params(1, n=4, max_tokens=max_tokens))[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in off.outputs]
    assert len({tuple(o.token_ids) for o in got.outputs}) > 1  # they did diverge (4 seeds)


@pytest.mark.parametrize("method", ["plain", "chain"])
def test_random_workload_with_preemption_keeps_outputs_and_blocks(tiny_dirs, heads, method):
    prompts = [SYSTEM[:n] + [7 + i] * (i % 3) for i, n in enumerate([23, 16, 20, 23, 9, 17, 23, 12])]
    prompts += [p + [5, 5] for p in prompts[:4]]
    sp = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=14 + i % 5, ignore_eos=True)
          for i in range(len(prompts))]
    runs = {}
    for caching in (True, False):
        engine = llm(tiny_dirs, method, heads["llama"], caching, num_kv_blocks=20, max_num_seqs=6,
                     max_model_len=64).engine
        got, aborted, preempted = random_workload(engine, prompts, sp, seed=5, abort_rate=0.04)
        blocks = engine.runner.blocks
        assert blocks.num_free == blocks.num_blocks and not any(blocks.ref)
        if caching:
            assert (preempted, engine.scheduler.prefix.hits > 0, blocks.evictions > 0) == (True, True, True)
            assert not engine.scheduler.prefix.computing_by and not engine.scheduler.prefix._promised
        runs[caching] = (got, aborted)
    (got_on, ab_on), (got_off, ab_off) = runs[True], runs[False]
    finished = set(range(len(prompts))) - ab_on - ab_off
    assert len(finished) >= len(prompts) // 2
    for i in finished:
        assert got_on[i] == got_off[i], i


def test_preempted_request_restarts_from_its_own_blocks(tiny_dirs):
    engine = llm(tiny_dirs, "plain", None, True).engine
    engine.add_request("x", SYSTEM, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    seq = engine.requests["x"]
    expected = min(seq.num_cached // 4, (len(seq.tokens) - 1) // 4) * 4  # complete blocks, next token known
    engine.scheduler.preempt(seq)
    before = engine.scheduler.prefix.hits
    engine.step()
    assert expected >= 16 and engine.scheduler.prefix.hits - before == expected


def test_block_manager_keeps_cached_blocks_until_it_needs_them():
    bm = BlockManager(4, 2)
    a = []
    bm.grow(a, 4)  # blocks 0, 1
    bm.set_key(a[0], b"k0")
    bm.set_key(a[1], b"k1")
    bm.set_key(a[1], b"k0")  # a key held elsewhere stays there
    assert bm.key_of == {0: b"k0", 1: b"k1"}
    bm.release(a)
    assert bm.num_free == 4 and bm.cached(b"k0") == 0
    b = []
    bm.grow(b, 4)  # the unkeyed blocks 2, 3 go first
    assert b == [2, 3] and bm.cached(b"k1") == 1
    assert bm.can_take([0], 2) and not bm.can_take([0], 6)
    c = bm.take([0])
    assert bm.ref[0] == 1 and 0 not in bm.free
    bm.grow(c, 4)  # evicts block 1, the only free one: its key goes with it
    assert c == [0, 1] and bm.cached(b"k1") is None and bm.evictions == 1
    bm.check([b, c])


def finished_with_head_behind(cache: prefix_cache.PrefixCache, tokens: list[int], head_at: int) -> Sequence:
    """A request whose target computed all but its last token and whose head covers [0, head_at), the rest
    kept as features (each row: its position, 2 values), released as a finished one."""
    seq = Sequence("r", tokens, SamplingParams(max_tokens=1), 0)
    cache.blocks.grow(seq.table, len(tokens))
    seq.num_cached, seq.draft_cached = len(tokens) - 1, head_at
    rows = seq.num_cached - head_at
    seq.head_backlog = Backlog(head_at, [torch.arange(head_at, seq.num_cached).float()[:, None].repeat(1, 2)], rows)
    cache.release(seq)
    cache.blocks.release(seq.table)
    return seq


def test_head_rows_pending_are_kept_with_their_blocks_within_their_budget():
    """A finished request whose head is behind: its blocks past the head's cover are keyed with the kept
    features (`Pending`), a hit starts the head where it stopped with those features as its backlog, and
    past the budget the least recently kept go, their keys with them (last blocks first)."""
    row = 2 * 4  # one row's features: 2 fp32 values
    cache = prefix_cache.PrefixCache(BlockManager(16, 4), b"root", drafter_kv=True, pending_bytes=6 * row)
    finished_with_head_behind(cache, list(range(13)), head_at=6)  # 3 full blocks; the head covers 6 rows
    assert [p.start for p in cache.pending.values()] == [8, 6]  # block 2 (the last) first: dropped first
    assert cache.pending_size == 6 * row
    again = Sequence("s", list(range(13)) + [50], SamplingParams(max_tokens=1), 0)
    hits = cache.lookup(again)
    assert len(hits) == 3
    cache.admit(again, hits)
    assert (again.num_cached, again.draft_cached) == (12, 6)
    backlog = again.head_backlog
    assert (backlog.start, backlog.rows) == (6, 6)
    assert torch.cat(backlog.parts)[:, 0].tolist() == list(range(6, 12))
    cache.release(again, keep=False)
    cache.blocks.release(again.table)
    finished_with_head_behind(cache, [7] * 9, head_at=0)  # 2 more pending blocks: 8 rows over the budget of 6
    assert cache.pending_size <= 6 * row
    # dropped, oldest first: the first request's pending blocks 2 and 1, then the new one's last block
    assert [p.start for p in cache.pending.values()] == [0]
    assert len(cache.lookup(Sequence("t", [7] * 9 + [1], SamplingParams(max_tokens=1), 0))) == 1
    assert len(cache.lookup(Sequence("u", list(range(13)), SamplingParams(max_tokens=1), 0))) == 1  # complete
    cache.blocks.check([])


def test_a_hit_never_runs_past_a_pending_block_into_one_that_is_not():
    """The head can catch up over pending rows only in order: a complete block after a pending one (its
    head KV computed over another prefix's head rows) ends the hit there."""
    cache = prefix_cache.PrefixCache(BlockManager(16, 4), b"root", drafter_kv=True, pending_bytes=1 << 20)
    seq = finished_with_head_behind(cache, list(range(13)), head_at=4)
    keys = seq.block_keys
    del cache.pending[keys[2]]  # as if block 2 were keyed complete
    assert len(cache.lookup(Sequence("s", list(range(13)), SamplingParams(max_tokens=1), 0))) == 2


def test_flag_pair_and_metrics(tiny_dirs):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--model", "m"])).enable_prefix_caching
    assert not engine_config(p.parse_args(["--model", "m", "--no-enable-prefix-caching"])).enable_prefix_caching
    config = EngineConfig(model=str(tiny_dirs["llama"]), block_size=4)
    with serving(config, "tiny", None) as server:
        for suffix in ([1, 2], [3, 4]):
            server.client.completions.create(model="tiny", prompt=SYSTEM + suffix, max_tokens=2)
        text = httpx.get(server.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("tsengine:prefix_cache_")}
    assert values["tsengine:prefix_cache_queries_total"] == 2 * (len(SYSTEM) + 2)
    assert values["tsengine:prefix_cache_hits_total"] == 20  # the second request found 5 blocks
