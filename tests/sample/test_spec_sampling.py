"""Sampling rules that keep the target's distribution: χ² against the exact distribution, per rule.

Two levels. The rules alone (`tsengine/sample/verify.py`) on synthetic p and q, where every branch can be
counted exactly, including the chain's acceptance rate 1 − TV(p, q). Then the whole engine on a tiny target
(384-token vocab): 20,000 requests with distinct seeds, the first three generated tokens against the exact
joint distribution computed from HF's logits. The engine tests draft with oracles that make acceptance
frequent (drafts from a q that half-agrees with p, or the target's own top children), because a rule that
rarely accepts would leave its accept branch untested; the head's own drafts are one more case.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.engine import PROMPTS, DraftRewriter
from tests.helpers.statistics import chi2_pvalue
from tsengine.entrypoints.llm import LLM
from tsengine.errors import UserError
from tsengine.sample.verify import multiround_draws, rejection_draws
from tsengine.sampling_params import SamplingParams
from tsengine.speculative.drafts import Drafts

N_SAMPLES, T, PROMPT = 20000, 1.0, [5, 17, 33]


# ---- the rules alone ---------------------------------------------------------------------------------------------
def chi2_merged(observed, expected, min_expected=5.0):
    """χ² p-value with the cells expected below `min_expected` pooled into one (Pearson's test is only
    trustworthy with expected counts of about 5 or more)."""
    small = expected < min_expected
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    return chi2_pvalue(observed, expected)


def _dist(g, v, sharp=1.5):
    return torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * sharp, -1)


def test_rejection_rule_samples_p_and_accepts_at_one_minus_tv():
    """Each verify row's draw is distributed as p, whatever q is, and the draft is accepted with
    probability Σ min(p, q) = 1 − TV(p, q)."""
    g, v, s, w = torch.Generator().manual_seed(0), 8, 3, N_SAMPLES
    p = torch.stack([_dist(g, v) for _ in range(s + 1)])  # rows 0..S
    q = torch.stack([_dist(g, v) for _ in range(s)])
    drafts = torch.stack([torch.multinomial(q[i], w, replacement=True, generator=g) for i in range(s)], 1)
    draws = rejection_draws(p.log().float().expand(w, -1, -1), drafts, q.float().expand(w, -1, -1),
                            torch.arange(w), torch.arange(s + 1).expand(w, -1) + 50)
    for i in range(s + 1):
        observed = torch.bincount(draws[:, i], minlength=v).double()
        assert chi2_merged(observed, p[i] * w) > 1e-3, f"row {i}"
    for i in range(s):
        rate = (draws[:, i] == drafts[:, i]).double().mean()
        want = torch.minimum(p[i], q[i]).sum()
        assert abs(rate - want) < 4 * (want * (1 - want) / w) ** 0.5, f"row {i}: {rate:.4f} vs 1-TV {want:.4f}"
    # a draft with p(x) > q(x) is always taken
    px, qx = (torch.stack([d[i][drafts[:, i]] for i in range(s)], 1) for d in (p, q))
    assert not (px > qx)[draws[:, :s] != drafts].any()


def test_multiround_rule_samples_p():
    """A root with three children, a node with one, a leaf: every node's draw is distributed as p (with
    children tried in order and the residual drawn when none is taken). Note that plain sampling from p
    would pass this too: exactness is the whole contract; which noise decides is not observable."""
    g, v, w = torch.Generator().manual_seed(1), 8, N_SAMPLES
    p = torch.stack([_dist(g, v, 2.0) for _ in range(5)])
    parents = torch.tensor([0, 0, 1, 0, 0])  # node 1 (child of root) has child 2; nodes 3, 4 are the root's
    tokens = torch.tensor([0, int(p[0].argmax()), 5, 2, int(p[0].argsort()[-2])])
    draws = multiround_draws(p.log().float().expand(w, -1, -1), tokens.expand(w, -1), parents.expand(w, -1),
                             torch.arange(w), torch.tensor([3, 4, 5, 4, 4]).expand(w, -1), topk=3)
    for node in range(5):
        observed = torch.bincount(draws[:, node], minlength=v).double()
        assert chi2_merged(observed, p[node] * w) > 1e-3, f"node {node}"


def make_llm(tiny_dirs, spec, **kw):
    return LLM(str(tiny_dirs["llama"]), speculative_config=spec, **kw)


# ---- the engine --------------------------------------------------------------------------------------------------
class Exact:
    """p(· | prefix) at temperature T from HF's logits in float64, for many prefixes at once (cached)."""

    def __init__(self, hf):
        self.hf, self.cache = hf, {}

    def __call__(self, prefixes):
        todo = sorted({p for p in prefixes if p not in self.cache})
        for n in sorted({len(p) for p in todo}):
            group = [p for p in todo if len(p) == n]
            with torch.no_grad():
                logits = self.hf(torch.tensor(group)).logits[:, -1].double()
            for p, row in zip(group, torch.softmax(logits / T, -1)):
                self.cache[p] = row
        return [self.cache[p] for p in prefixes]


class OracleChainQ(DraftRewriter):
    """Chain drafts sampled from q = (p + w) / 2 restricted to the draft vocab (w a fixed random
    distribution), q recorded for the rejection rule: acceptance is frequent, and neither branch is rare."""

    def __init__(self, engine, exact: Exact, seed=0):
        super().__init__(engine)
        self.exact, self.ids = exact, self.inner.draft_ids_in_target
        self.g = torch.Generator().manual_seed(seed)
        self.w = torch.softmax(torch.randn(engine.runner.vocab_size, generator=self.g, dtype=torch.float64) * 2, -1)

    def rewrite(self, seqs, drafts):
        paths, xs, qs = [tuple(s.tokens) for s in seqs], [[] for _ in seqs], [[] for _ in seqs]
        for _ in range(self.engine.spec_steps):
            for j, p in enumerate(self.exact(paths)):
                q = ((p + self.w) / 2)[self.ids]
                q = q / q.sum()
                x = int(self.ids[torch.multinomial(q, 1, generator=self.g)])
                xs[j].append(x)
                qs[j].append(q.float())
                paths[j] = paths[j] + (x,)
        return [Drafts(torch.tensor(x), q=torch.stack(q), q_ids=self.ids) for x, q in zip(xs, qs)]


class OracleTreeTop(DraftRewriter):
    """Keep the head's tree shape; give each node's children the target's likeliest tokens for the node's
    path, best first (deterministic given the prefix, as the multi-round rule's point masses are)."""

    def __init__(self, engine, exact: Exact):
        super().__init__(engine)
        self.exact = exact

    def rewrite(self, seqs, drafts):
        trees = [(d.tree.parents.tolist(), d.tree.depths.tolist()) for d in drafts]
        paths = [{0: tuple(s.tokens)} for s in seqs]
        tokens = [[0] * len(t[0]) for t in trees]
        for d in range(1, max(max(t[1]) for t in trees) + 1):  # one batched lookup per depth
            level = [[i for i in range(1, len(par)) if dep[i] == d] for par, dep in trees]
            wanted = [(j, h) for j, (par, _) in enumerate(trees) for h in sorted({par[i] for i in level[j]})]
            ranked = {w: p.argsort(descending=True).tolist() for w, p in
                      zip(wanted, self.exact([paths[j][h] for j, h in wanted]))}
            for j, (par, _) in enumerate(trees):
                for i in level[j]:
                    siblings = [c for c in level[j] if par[c] == par[i]]
                    tokens[j][i] = ranked[(j, par[i])][siblings.index(i)]
                    paths[j][i] = paths[j][par[i]] + (tokens[j][i],)
        return [dataclasses.replace(d, tokens=torch.tensor(t[1:])) for d, t in zip(drafts, tokens)]


def expected_joint(exact: Exact, prompt, n: int, min_count: float = 5.0):
    """Cells (t1, t2, t3) whose expected count is at least `min_count`, with their expected counts."""
    cells, frontier = {}, {(): 1.0}
    for depth in range(3):
        nxt = {}
        for prefix, p in zip(frontier, exact([tuple(prompt) + k for k in frontier])):
            for t in (p * frontier[prefix] * n >= min_count).nonzero().flatten().tolist():
                nxt[prefix + (t,)] = float(p[t]) * frontier[prefix]
        frontier = nxt
    for k, prob in frontier.items():
        cells[k] = prob * n
    return cells


def chi2_against_exact(outputs, cells, n):
    keys = list(cells)
    index = {k: i for i, k in enumerate(keys)}
    observed = torch.zeros(len(keys) + 1, dtype=torch.float64)
    for o in outputs:
        observed[index.get(tuple(o.outputs[0].token_ids[:3]), len(keys))] += 1
    expected = torch.tensor([cells[k] for k in keys] + [n - sum(cells.values())], dtype=torch.float64)
    assert expected[-1] >= 5, "the pooled cell is too small for the χ² approximation"
    return chi2_pvalue(observed, expected)


RULES = {  # name: (speculative_config additions, oracle)
    "rejection-chain": ({"num_speculative_tokens": 2, "enable_speculative_sampling": True}, OracleChainQ),
    "multiround-tree": ({"num_speculative_tokens": 2, "eagle_topk": 3, "num_draft_tokens": 6,
                         "tree_sampling": "multiround"}, OracleTreeTop),
    "gumbel-tree": ({"num_speculative_tokens": 2, "eagle_topk": 3, "num_draft_tokens": 6}, None),
    "rejection-chain-head": ({"num_speculative_tokens": 2, "enable_speculative_sampling": True}, None),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_engine_first_tokens_match_the_exact_distribution(tiny_dirs, tiny_models, heads, rule):
    """20,000 seeds, one prompt: the joint of the first three tokens (t1 from the prefill's plain draw, t2
    and t3 from verification, accepted drafts or residual/bonus draws) passes χ² against HF's exact joint."""
    extra, oracle = RULES[rule]
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), **extra}
    llm = make_llm(tiny_dirs, spec, block_size=16, max_num_seqs=512, max_num_batched_tokens=4096)
    exact = Exact(tiny_models["llama"][0])
    if oracle is not None:
        oracle(llm.engine, exact)
    params = [SamplingParams(temperature=T, max_tokens=3, ignore_eos=True, seed=i) for i in range(N_SAMPLES)]
    outputs = llm.generate([PROMPT] * N_SAMPLES, params)
    cells = expected_joint(exact, PROMPT, N_SAMPLES)
    assert len(cells) >= 20, "too few cells for a meaningful test"
    st = llm.engine.stats
    floor = 0.2 if oracle is not None else 0.05  # the head's own drafts accept less, but must accept
    assert st.num_accepted > floor * st.num_drafts, "the accept branch was barely exercised"
    pvalue = chi2_against_exact(outputs, cells, N_SAMPLES)
    print(f"{rule}: {len(cells)} cells, accepted {st.num_accepted} over {st.num_drafts} windows, p = {pvalue:.3g}")
    assert pvalue > 1e-3


@pytest.mark.parametrize("extra", [RULES["rejection-chain"][0], RULES["multiround-tree"][0]],
                         ids=["rejection", "multiround"])
def test_rules_keep_greedy_exact_and_seeds_reproducible(tiny_dirs, heads, extra):
    """In a mixed batch, greedy rows under either rule equal plain greedy decoding token for token, and a
    seeded sampled request returns the same tokens when run again in another batch."""
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), **extra}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in (3, 4)]
    plain = make_llm(tiny_dirs, None, block_size=4).generate(PROMPTS, greedy)
    llm = make_llm(tiny_dirs, spec, block_size=4, max_num_batched_tokens=16, debug_checks=True)
    a = llm.generate(PROMPTS, [greedy, sampled[0], greedy, sampled[1]])
    b = llm.generate(PROMPTS[1::2], sampled)
    assert [a[i].outputs[0].token_ids for i in (0, 2)] == [plain[i].outputs[0].token_ids for i in (0, 2)]
    assert [a[i].outputs[0].token_ids for i in (1, 3)] == [o.outputs[0].token_ids for o in b]


def test_speculative_sampling_blockers(tiny_dirs, heads):
    """Rejection sampling is a chain rule with a recorded q (not NGRAM, not a tree); multiround is the tree's."""
    cases = [({"method": "eagle3", "model": str(heads["llama"]), "num_speculative_tokens": 2,
               "adaptive": False, "eagle_topk": 2,
               "num_draft_tokens": 5, "enable_speculative_sampling": True}, ["use --spec-tree-sampling multiround"]),
             ({"method": "ngram", "num_speculative_tokens": 2, "enable_speculative_sampling": True},
              ["NGRAM drafts have none"]),
             ({"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 2,
               "tree_sampling": "multiround"},
              ["a chain (speculative_eagle_topk 1) uses --enable-speculative-sampling"])]
    for spec, msgs in cases:
        with pytest.raises(UserError, match="every blocker") as e:
            make_llm(tiny_dirs, spec)
        for m in msgs:
            assert m in str(e.value)


def test_rule_flags_resolve_and_conflict():
    from tsengine.config import SpeculativeConfig

    cfg = SpeculativeConfig.resolve("EAGLE3", "/h", 3, speculative_sampling=True)
    assert cfg.rule == "rejection"
    assert SpeculativeConfig.resolve(config_json={"method": "eagle3", "model": "/h", "num_speculative_tokens": 3,
                                                  "topk": 2, "num_draft_tokens": 6,
                                                  "tree_sampling": "multiround"}).rule == "multiround"
    with pytest.raises(UserError, match="without speculative decoding"):
        SpeculativeConfig.resolve(speculative_sampling=True)
    assert SpeculativeConfig.resolve(speculative_sampling=False, tree_sampling="gumbel") is None  # defaults: no-ops
    with pytest.raises(UserError, match="conflicts with the flag for tree_sampling"):
        SpeculativeConfig.resolve(config_json={"method": "eagle3", "model": "/h", "tree_sampling": "gumbel"},
                                  tree_sampling="multiround")
    with pytest.raises(UserError, match="tree_sampling"):
        SpeculativeConfig.resolve("EAGLE3", "/h", 3, tree_sampling="beam")


def test_recorded_q_memory_is_accounted(tiny_dirs, heads, caplog):
    """Rejection sampling reserves max_num_seqs x steps x (draft vocab + vocab) x 4 bytes before the KV
    cache is sized, and says so at startup."""
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 2,
            "enable_speculative_sampling": True}
    with caplog.at_level("INFO", logger="tsengine"):
        llm = make_llm(tiny_dirs, spec, max_num_seqs=8, kv_cache_memory=4 << 20)
    r = llm.engine.runner
    assert r.q_bytes == 8 * 2 * (256 + r.vocab_size) * 4
    assert "recorded draft distributions take up to" in caplog.text
    plain = make_llm(tiny_dirs, {**spec, "enable_speculative_sampling": False}, max_num_seqs=8, kv_cache_memory=4 << 20)
    assert plain.engine.runner.q_bytes == 0 and plain.engine.runner.blocks.num_blocks > r.blocks.num_blocks
