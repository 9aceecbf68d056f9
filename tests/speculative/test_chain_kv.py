"""The greedy chain keeps its own KV beside the paged draft cache (tsengine/speculative/chain_kv.py): each step equals
the same step written into the cache and read back by paged attention, and the chain writes nothing."""

from __future__ import annotations

import torch

from tsengine.entrypoints.llm import LLM
from tsengine.model.context import Context


def _proposer(tiny_dirs, heads):
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}
    return LLM(str(tiny_dirs["llama"]), speculative_config=spec, enforce_eager=True, block_size=4).engine.proposer


def test_each_chain_step_equals_writing_its_kv_into_the_cache(tiny_dirs, heads):
    """Two requests with random cached pasts of 10 and 3 positions, non-consecutive blocks: four chain steps
    through `ChainKV` equal four steps that write their KV into the paged cache (the oracle), step by step,
    and the cache is left as it was."""
    torch.manual_seed(0)
    eagle = _proposer(tiny_dirs, heads)
    k_cache, v_cache = eagle.kv
    k_cache.normal_()
    v_cache.normal_()
    before = (k_cache.clone(), v_cache.clone())
    tables = torch.tensor([[5, 2, 7, 1], [3, 6, 0, 0]])
    pos = torch.tensor([9, 2])  # each request's last cached draft position
    width = eagle.head.fc.weight.shape[0]
    hidden = torch.randn(2, width)
    ids = torch.randint(0, eagle.head.config.vocab_size, (4, 2))

    chain = eagle.chain_kv(tables, pos, hidden.dtype)
    got, h = [], hidden
    for s in range(4):
        h = eagle._layer(ids[s], h, pos + 1 + s, chain=chain)
        got.append(h)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "the chain wrote the cache"

    want, h = [], hidden
    for s in range(4):
        h = eagle._layer(ids[s], h, pos + 1 + s, Context.one_each(tables, pos + 1 + s, eagle.block_size))
        want.append(h)
    for s, (g, w) in enumerate(zip(got, want)):
        # summed in another order
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"chain step {s}: {m}")


def test_the_greedy_chain_drafts_what_the_cache_writing_chain_drafts(tiny_dirs, heads):
    """`greedy_chain` (what the engine's graphs trace) against the chain written out step by step into the
    cache: the same draft ids, from the same first token on."""
    torch.manual_seed(1)
    eagle = _proposer(tiny_dirs, heads)
    k_cache, v_cache = eagle.kv
    k_cache.normal_()
    v_cache.normal_()
    tables = torch.tensor([[4, 1, 6], [2, 0, 0], [3, 5, 0]])
    pos = torch.tensor([7, 0, 5])
    hidden = torch.randn(3, eagle.head.fc.weight.shape[0])
    got = eagle.greedy_chain(hidden, pos, tables, steps=4)

    def pick(out):
        return eagle.draft_ids_in_target[eagle.head.logits(out).argmax(-1)]

    want, h = [pick(hidden)], hidden
    for s in range(1, 4):
        h = eagle._layer(want[-1], h, pos + s, Context.one_each(tables, pos + s, eagle.block_size))
        want.append(pick(h))
    assert got.tolist() == torch.stack(want, dim=1).tolist()
