"""Tree speculation in the engine against its oracles: plain greedy and seeded plain sampling (token for
token, mixed batches, chunked prefill), the reference drafter's trees, a dense attention loop for tree
windows, and the validation / support errors (docs/design/tree-speculation.md)."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

from tests.helpers.engine import PROMPTS, greedy_truth
from tsengine.config import SpeculativeConfig
from tsengine.entrypoints.llm import LLM
from tsengine.errors import UserError
from tsengine.infer.reference import ReferenceSpeculator, SpecShape
from tsengine.model.attention import paged_attention_torch
from tsengine.model.context import Context
from tsengine.sampling_params import SamplingParams

SHAPES = [(3, 2, 6), (4, 3, 10), (2, 4, 7)]  # (steps, topk, num_draft_tokens)


def make_llm(tiny_dirs, kind="llama", head=None, shape=(3, 2, 6), **kw):
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 24, **kw}
    spec = None
    if head:
        s, k, n = shape
        spec = {"method": "eagle3", "adaptive": False, "model": str(head), "num_speculative_tokens": s, "eagle_topk": k,
                "num_draft_tokens": n}
    return LLM(str(tiny_dirs[kind]), speculative_config=spec, **kw)


class OracleTreeDrafts:
    """Keep the drafted tree's shape, but put the known continuation on the path to one random node (a
    random depth, any node of it) and wrong, distinct tokens everywhere else. Every accept length
    occurs, and accepted paths off the first-child line exercise the KV move."""

    def __init__(self, engine, truth: dict[tuple, list[int]], seed=0, vocab=256):
        self.engine, self.truth, self.rng, self.vocab = engine, truth, random.Random(seed), vocab
        self.inner, self.moved = engine.proposer, 0
        engine.proposer = self
        inner_move = engine.verifier.move_accepted

        def count(moves):
            self.moved += len(moves)
            inner_move(moves)
        engine.verifier.move_accepted = count

    def propose(self, proposal):
        return [self._oracle(seq, d) for seq, d in zip(proposal.drafting, self.inner.propose(proposal))]

    def _oracle(self, seq, drafts):
        if drafts is None:
            return None
        parents, depths = drafts.tree.parents.tolist(), drafts.tree.depths.tolist()
        cont = self.truth[tuple(seq.tokens[:seq.prompt_len])][seq.num_output:] + [0] * 16
        depth = self.rng.randint(0, max(depths))  # every depth equally likely (deep nodes are few)
        target = self.rng.choice([i for i, d in enumerate(depths) if d == depth])  # 0: nothing on the path is right
        path = set()
        node = target
        while node:
            path.add(node)
            node = parents[node]
        tokens = []
        for i in range(1, len(parents)):
            right = cont[depths[i] - 1]
            tokens.append(right if i in path else (right + 1 + i) % self.vocab)
        return dataclasses.replace(drafts, tokens=torch.tensor(tokens, dtype=torch.long))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tree_greedy_equals_greedy_mixed_batch(tiny_dirs, heads, kind, shape):
    truth = greedy_truth(tiny_dirs, kind, 40)
    llm = make_llm(tiny_dirs, kind, heads[kind], shape)
    oracle = OracleTreeDrafts(llm.engine, truth, seed=shape[1])
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for p, o in zip(PROMPTS, out):
        assert o.outputs[0].token_ids == truth[tuple(p)]
    st = llm.engine.stats
    assert st.num_accepted > 0 and st.accepted_per_pos[-1] > 0, "never accepted to full depth"
    assert oracle.moved > 0, "no accepted path needed moving: the KV move went untested"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_seeded_sampling_is_identical_to_plain(tiny_dirs, heads, kind):
    params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=11),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_tokens=25, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.7, min_p=0.05, max_tokens=30, ignore_eos=True, seed=2**40 + 3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    plain = make_llm(tiny_dirs, kind).generate(PROMPTS, params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain)}
    for shape in SHAPES[:2]:
        llm = make_llm(tiny_dirs, kind, heads[kind], shape)
        OracleTreeDrafts(llm.engine, truth, seed=7)
        spec = llm.generate(PROMPTS[::-1], params[::-1])[::-1]
        for a, b in zip(plain, spec):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"shape {shape}"
        assert llm.engine.stats.num_accepted > 0
    # and with the head's own drafts (no oracle): still the plain tokens
    spec = make_llm(tiny_dirs, kind, heads[kind], SHAPES[0]).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_engine_tree_equals_the_reference_drafter(tiny_dirs, tiny_models, heads, shape):
    """After prefill (chunked), the engine's tree (tokens, parents, depth-first order) equals
    infer/reference's EAGLE-2 tree for the same committed tokens."""
    hf, _ = tiny_models["llama"]
    from tsengine.eagle3.format import load_head

    head = load_head(heads["llama"], target=hf.config, embeddings=hf.get_input_embeddings().weight)
    ref = ReferenceSpeculator(hf, head, SpecShape(*shape))
    for budget in (64, 7):
        e = make_llm(tiny_dirs, "llama", heads["llama"], shape, max_num_batched_tokens=budget).engine
        e.add_request("r", PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for _ in range(3):  # prefill, then two verify steps: trees drafted after accepted paths too
            while not e.requests["r"].num_output:
                e.step()
            seq = e.requests["r"]
            with torch.no_grad():
                feats = ref._target(seq.tokens[:-1])[1]
            want = ref.draft(seq.tokens, feats)
            assert seq.drafts.tokens.tolist() == want.tokens, f"budget {budget}"
            assert seq.drafts.tree.parents.tolist() == [0] + [p + 1 for p in want.parents]
            assert seq.drafts.tree.depths.tolist() == [0] + want.depths
            e.step()


# ---- attention over tree windows ------------------------------------------------------------------------------
def dense_tree_attention(q, k_cache, v_cache, ctx, scale):
    """Float64 loop: token t sees KV indices below its window start and the window slots in its bits."""
    bs, nh, nkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(ctx.num_tokens):
        b, st, bits = int(ctx.seq_index[t]), int(ctx.tree_start[t]), int(ctx.tree_anc[t])
        js = [j for j in range(int(ctx.context_lens[b])) if j < st or (j - st < 64 and bits >> (j - st) & 1)]
        k = torch.stack([k_cache[int(ctx.block_tables[b, j // bs]), j % bs] for j in js]).double()
        v = torch.stack([v_cache[int(ctx.block_tables[b, j // bs]), j % bs] for j in js]).double()
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), k) * scale, -1)
        out[t] = torch.einsum("hn,nhd->hd", w, v)
    return out


def attend(kernel, q, k_cache, v_cache, ctx, scale):
    """The torch backend, or one Triton kernel forced (interpreted on the CPU) with small tiles, so that a
    short prefix still spans several key tiles."""
    if kernel == "torch":
        return paged_attention_torch(q, k_cache, v_cache, ctx, scale)
    from tsengine.model.kernels.paged_attention import _decode, _prefill

    if kernel == "decode":
        return _decode(q, k_cache, v_cache, ctx, scale, block_n=16)
    return _prefill(q, k_cache, v_cache, ctx, scale, block_m=8, block_n=16)


KERNELS = ["torch", "decode", "prefill"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_tree_window_attention_matches_dense_loop(kernel):
    """A mixed step: a prefill chunk, two tree windows (one on consecutive blocks), a decode token. And a
    one-request step on consecutive blocks (the cache-view path)."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(24, 4, 2, 16, generator=g), torch.randn(24, 4, 2, 16, generator=g)
    parents = torch.tensor([[0, 0, 1, 0, 3, 3], [0, 0, 0, 1, 2, 4]])
    from tsengine.speculative.tree import ancestor_bits

    anc = ancestor_bits(parents, 3)
    depths = torch.tensor([[0, 1, 2, 1, 2, 2], [0, 1, 1, 2, 2, 3]])
    runs = [([5, 9, 2], 3, 7), ([0, 1, 3, 4], 9, 6), ([6, 7, 8, 10], 7, 6), ([11, 12], 4, 1)]
    ctx = Context.build(runs, 4, "cpu")
    ctx.set_trees(torch.tensor([[7 + i for i in range(6)], [13 + i for i in range(6)]]), torch.tensor([9, 7]),
                  depths, anc)
    assert ctx.positions[7:13].tolist() == [9 + d for d in depths[0].tolist()]  # position follows depth
    # slot: node
    assert ctx.slot_mapping[7:13].tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 4 * 4, 4 * 4 + 1, 4 * 4 + 2]
    q = torch.randn(ctx.num_tokens, 4, 16, generator=g)
    out = attend(kernel, q, k_cache, v_cache, ctx, 0.25)
    torch.testing.assert_close(out.double(), dense_tree_attention(q, k_cache, v_cache, ctx, 0.25), atol=1e-5, rtol=1e-5)
    one = Context.build([([2, 3, 4], 5, 6)], 4, "cpu")
    assert one.dense_base is not None
    one.set_trees(torch.arange(6)[None], torch.tensor([5]), depths[:1], anc[:1])
    q1 = torch.randn(6, 4, 16, generator=g)
    torch.testing.assert_close(attend(kernel, q1, k_cache, v_cache, one, 0.25).double(),
                               dense_tree_attention(q1, k_cache, v_cache, one, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_draft_lane_context_matches_dense_loop(kernel):
    """Draft-tree steps: K nodes per request in lanes after the prefix, each seeing its ancestors' lanes."""
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(16, 4, 2, 16, generator=g), torch.randn(16, 4, 2, 16, generator=g)
    tables = torch.tensor([[3, 1, 7, 9], [0, 2, 4, 5]])
    start = torch.tensor([6, 9])  # prefix lengths
    k, s = 3, 2
    lanes = start[:, None] + (s - 1) * k + torch.arange(k)
    anc = torch.tensor([[0b1001, 0b10010, 0b100001], [0b1100, 0b10001, 0b100100]])
    ctx = Context.lanes(tables, (start - 1 + s)[:, None].expand(2, k), lanes, start, anc, 4)
    q = torch.randn(6, 4, 16, generator=g)
    torch.testing.assert_close(attend(kernel, q, k_cache, v_cache, ctx, 0.25).double(),
                               dense_tree_attention(q, k_cache, v_cache, ctx, 0.25), atol=1e-5, rtol=1e-5)


# ---- validation and support -------------------------------------------------------------------------------------
@pytest.mark.parametrize("topk, steps, n", [(16, 5, 64), (8, 9, 64), (2, 3, 6), (1, 4, 5)])
def test_largest_valid_tree_shapes(topk, steps, n):
    cfg = SpeculativeConfig.resolve("EAGLE3", "/h", steps, topk, n)
    assert (cfg.eagle_topk, cfg.num_steps, cfg.num_draft_tokens) == (topk, steps, n)


@pytest.mark.parametrize("topk, steps, n, msgs", [
    (4, 5, 8, ["16 draft lanes exceed speculative_num_draft_tokens 8"]),
    (16, 6, 64, ["80 draft lanes exceed"]),
    (2, 2, 8, ["exceeds what 2 steps of top-2 can draft: 1 + K + (S-1)*K^2 = 7"]),
    (17, 11, 65, ["speculative_num_steps is 11", "speculative_eagle_topk is 17", "allowed: 2..64"]),
    (3, 3, None, ["must be given for a tree"]),
    (1, 3, 5, ["must equal speculative_num_steps + 1 = 4"]),
])
def test_invalid_tree_shapes_list_every_violation(topk, steps, n, msgs):
    with pytest.raises(UserError) as e:
        SpeculativeConfig.resolve("EAGLE3", "/h", steps, topk, n)
    for m in msgs:
        assert m in str(e.value)


def test_support_check_lists_every_blocker(tiny_dirs, tiny_models, tmp_path):
    """Rejection sampling asked of a tree, with topk above the head's draft vocab: one refusal, both
    blockers named (sampler and drafter), before any weight of the target is loaded."""
    from tests.helpers.heads import random_head
    from tsengine.eagle3.format import save_head

    small = save_head(random_head(tiny_models["llama"][0], seed=1, draft_vocab_size=8), tmp_path / "small")
    spec = {"method": "eagle3", "adaptive": False, "model": str(small), "num_speculative_tokens": 3, "eagle_topk": 16,
            "num_draft_tokens": 40, "enable_speculative_sampling": True}
    with pytest.raises(UserError, match=re.escape("every blocker")) as e:
        LLM(str(tiny_dirs["llama"]), speculative_config=spec, attention_backend="triton")
    text = str(e.value)
    assert "sampler rejection (--enable-speculative-sampling): verifies a chain" in text
    assert "speculative_eagle_topk 16 exceeds the head's draft vocab size 8" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_full_64_node_windows(kernel, dtype):
    """The largest windows (64 nodes: bit 63 is the sign bit of the int64 mask) behind long, shuffled
    prefixes, two requests plus a decode token, random trees; against the float64 loop."""
    from tsengine.speculative.tree import ancestor_bits

    g = torch.Generator().manual_seed(7)
    n, bs = 64, 8
    parents = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                      torch.randint(0, 1 << 20, (n - 1,), generator=g) % torch.arange(1, n)])
                           for _ in range(2)])
    depths = torch.zeros_like(parents)
    for i in range(1, n):
        depths[:, i] = depths.gather(1, parents[:, i:i + 1])[:, 0] + 1
    anc = ancestor_bits(parents, int(depths.max()))
    assert (anc < 0).any()  # node 63 of some window: bit 63 set
    perm = torch.randperm(40, generator=g).tolist()
    runs = [(perm[:12], 30, n), (perm[12:26], 45, n), (perm[26:30], 20, 1)]
    ctx = Context.build(runs, bs, "cpu")
    ctx.set_trees(torch.stack([torch.arange(n), n + torch.arange(n)]), torch.tensor([30, 45]), depths, anc)
    k_cache, v_cache = (torch.randn(40, bs, 2, 16, generator=g).to(dtype),
                        torch.randn(40, bs, 2, 16, generator=g).to(dtype))
    q = torch.randn(ctx.num_tokens, 4, 16, generator=g).to(dtype)
    out = attend(kernel, q, k_cache, v_cache, ctx, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), dense_tree_attention(q, k_cache, v_cache, ctx, 0.25), atol=tol, rtol=tol)


def test_tree_greedy_on_the_triton_backend(tiny_dirs, heads):
    """The whole engine with tree windows and draft lanes through the Triton kernels (interpreted here):
    greedy output equals plain greedy, accepted paths off the first-child line included."""
    truth = greedy_truth(tiny_dirs, "llama", 12)
    llm = make_llm(tiny_dirs, "llama", heads["llama"], (3, 2, 6), attention_backend="triton")
    assert llm.engine.runner.backend == "triton"
    oracle = OracleTreeDrafts(llm.engine, truth, seed=2)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [truth[tuple(p)] for p in PROMPTS[:2]]
    assert oracle.moved > 0 and llm.engine.stats.num_accepted > 0


@pytest.mark.parametrize("shape", [(3, 1, 4), *SHAPES], ids=str)
def test_default_kv_cache_holds_every_request_to_the_last_token(tiny_dirs, heads, shape):
    """The default CPU cache is sized for max_num_seqs requests at max_model_len with speculation's own
    positions (a verify window at the last allowed token plus the drafter's reserve,
    `startup.positions_per_request`): requests running together to the last token are never preempted. A
    preemption would commit a token outside a verify step, and the engine eval's τ would not be the
    reference's (it was, for a (3, 2, 6) tree)."""
    new, prompts = 30, [PROMPTS[0]] * 3  # equal lengths: all three reach the last position together
    llm = make_llm(tiny_dirs, "llama", heads["llama"], shape, max_num_seqs=3, max_model_len=len(PROMPTS[0]) + new + 1)
    preempted, inner = [], llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), inner(seq))
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    assert not preempted
    assert all(sum(o.outputs[0].spec_accept_lengths) == new - 1 for o in out)
