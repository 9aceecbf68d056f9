"""Compiled step graphs (tsengine/model/graphs.py) against the eager engine: the same tokens for every method, and
padding that never touches a real row. The rest of the suite runs eagerly (tests/conftest.py); `make
test-compiled` runs the engine's losslessness tests compiled."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.engine import PROMPTS, random_workload
from tests.tiny import make_target
from tsengine.cache.kv_cache import scratch_slot
from tsengine.entrypoints.llm import LLM
from tsengine.model.context import Context
from tsengine.model.graph_compiler import compile_step
from tsengine.model.graphs import Heat, Shape
from tsengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.setenv("TSENGINE_ENFORCE_EAGER", "0")


def _llm(tiny_dirs, eager: bool, spec=None, **kw):
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    return LLM(str(tiny_dirs["llama"]), speculative_config=spec, enforce_eager=eager, **kw)


def _tokens(llm, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("method", ["plain", "chain", "tree", "ngram"])
def test_compiled_steps_equal_eager_steps(tiny_dirs, heads, method):
    """Greedy and seeded sampling, a mixed batch with chunked prefill: compiled == eager token for token, and
    the compiled engine really ran its decode/verify steps through graphs."""
    spec = {"chain": {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3},
            "tree": {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3,
                     "eagle_topk": 2, "num_draft_tokens": 6},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3}}.get(method)
    params = [GREEDY, SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=7)] * 2
    eager, compiled = _llm(tiny_dirs, True, spec), _llm(tiny_dirs, False, spec)
    assert eager.engine.runner.compiled is None and compiled.engine.runner.compiled is not None
    assert _tokens(compiled, params) == _tokens(eager, params)
    assert compiled.engine.runner.compiled.steps > 0
    if spec is not None:
        assert compiled.engine.stats.num_drafts > 0


def test_padding_rows_never_change_a_real_row(tiny_dirs):
    """Three decoding requests padded to a batch of 4 and a context of 256: the real rows' logits equal the
    eager forward's, their KV writes too, and no other slot changes but the scratch block's."""
    llm = _llm(tiny_dirs, False)
    r = llm.engine.runner
    for k, v in r.kv:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in r.kv]
    runs = [([3, 4, 5], 9, 1), ([7], 2, 1), ([10, 11], 5, 1)]
    ids = torch.tensor([11, 22, 33])

    eager_kv = [(k.clone(), v.clone()) for k, v in before]
    ctx = Context.build(runs, r.block_size, "cpu")
    hidden, _ = r.model(ids, ctx, eager_kv)
    want = r.model.logits(hidden)

    shape = Shape(4, 1, 256, False)
    r.compiled.heat = Heat(after=1)  # compiled on first sight
    _, _, got = r.compiled.forward(shape, ids, Context.build(runs, r.block_size, "cpu"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    scratch = scratch_slot(r.kv)
    written = ctx.slot_mapping.tolist()
    for (k, v), (ek, ev), (k0, _) in zip(r.kv, eager_kv, before):
        flat, eflat, flat0 = k.flatten(0, 1), ek.flatten(0, 1), k0.flatten(0, 1)
        torch.testing.assert_close(flat[written], eflat[written], atol=1e-5, rtol=1e-5)
        others = [s for s in range(scratch) if s not in written]
        assert torch.equal(flat[others], flat0[others]), "a padding row wrote outside the scratch block"
        assert not torch.equal(flat[scratch:], flat0[scratch:]), "the padding rows should write to scratch"


def test_the_head_extension_graph_equals_eager_and_pads_into_scratch(tiny_dirs, heads):
    """Runs of 1, 3 and 2 committed rows padded to a window of 4 and a batch of 4: the head's outputs equal
    its eager layer's, its KV writes too, and no draft slot changes but theirs and the scratch block's."""
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}
    eagle = _llm(tiny_dirs, False, spec).engine.proposer
    eagle.graphs.extends = True  # opt-in (TSENGINE_EXTEND_GRAPHS=1)
    eagle.graphs.heat = Heat(after=1)  # compiled on first sight
    k_cache, v_cache = eagle.kv
    k_cache.normal_()
    v_cache.normal_()
    before, v_before = k_cache.clone(), v_cache.clone()
    runs = [([3, 4, 5], 9, 1), ([7], 1, 3), ([10, 11], 5, 2)]
    ids = [11, 22, 33, 44, 55, 66]
    aux = torch.randn(6, eagle.head.fc.weight.shape[1])
    got = eagle.graphs.extend(runs, ids, aux)
    assert ("extend", 4, 4, 256) in eagle.graphs.graphs
    graph_k = k_cache.clone()
    k_cache.copy_(before)
    v_cache.copy_(v_before)
    ctx = Context.build(runs, eagle.block_size, "cpu")
    want = eagle._layer(torch.tensor(ids), eagle.head.project(aux), ctx.positions, ctx)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # the compiler reorders some sums
    written, scratch = ctx.slot_mapping.tolist(), scratch_slot([eagle.kv])
    flat, eager_flat, flat0 = graph_k.flatten(0, 1), k_cache.flatten(0, 1), before.flatten(0, 1)
    torch.testing.assert_close(flat[written], eager_flat[written], atol=1e-4, rtol=1e-4)
    others = [s for s in range(scratch) if s not in written]
    assert torch.equal(flat[others], flat0[others]), "a padding row wrote outside the scratch block"


def test_engines_of_one_shape_each_run_their_own_weights(tiny_dirs, heads, tmp_path):
    """Each compiled step skips dynamo's module guards (`graph_compiler.compile_step`): two compiled engines in one
    process, targets of the same shapes with different weights and norm epsilon, drafting with one head,
    each give their own eager tokens, whichever ran last. Fails if the graphs share a compiled entry (measured)."""
    other = make_target(tmp_path / "other", kind="llama", seed=5)
    config = json.loads((other / "config.json").read_text())  # a constant the graph bakes in, not a tensor:
    config["rms_norm_eps"] = 0.5  # a graph reused across engines would run the other engine's value
    (other / "config.json").write_text(json.dumps(config))
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}

    def llm(path, eager):
        return LLM(str(path), speculative_config=spec, enforce_eager=eager, debug_checks=True, block_size=4,
                   max_num_batched_tokens=16)

    params = [GREEDY] * len(PROMPTS)
    a, b = llm(tiny_dirs["llama"], False), llm(other, False)
    first_a, got_b, again_a = _tokens(a, params), _tokens(b, params), _tokens(a, params)
    assert first_a == again_a == _tokens(llm(tiny_dirs["llama"], True), params)
    assert got_b == _tokens(llm(other, True), params)
    assert got_b != first_a  # different weights: a shared graph would have shown as equal tokens
    assert a.engine.runner.compiled.steps > 0 and b.engine.runner.compiled.steps > 0


def test_which_steps_take_a_graph(tiny_dirs):
    """Decode and uniform verify steps do; prefill chunks, mixed windows and oversized batches do not."""
    from types import SimpleNamespace as NS

    r = _llm(tiny_dirs, False, max_num_seqs=80).engine.runner
    g = r.compiled

    def step(*windows, verify=True):
        batch = [NS(num_tokens=n, verify=verify and n > 1, seq=NS(capture=None)) for n in windows]
        return g.shape_for(batch, NS(max_ctx=300), tree=False)

    assert step(1, 1, 1) == Shape(4, 1, 512, False)
    assert step(4, 4) == Shape(2, 4, 512, False)
    assert step(4, 1) is None  # a request decoding beside verify windows
    assert step(5, verify=False) is None  # a prefill chunk
    assert step(*[1] * 65) is None  # above the largest batch bucket
    assert g.contexts[0] == 256 and g.contexts[-1] >= r.max_model_len


def test_a_shape_compiles_once_hot_and_a_rare_one_never():
    """A shape met once (an exploration step) runs eagerly; one met on `after` steps within the window
    compiles; one met every `window` steps never does."""
    heat = Heat(after=3, window=8)
    seen = []
    for step in range(40):
        heat.tick()
        seen.append(("rare", heat.hot("rare")) if step % 8 == 0 else ("common", heat.hot("common")))
    rare = [hot for key, hot in seen if key == "rare"]
    common = [hot for key, hot in seen if key == "common"]
    assert not any(rare)
    assert common[:2] == [False, False] and all(common[2:])


def test_the_engine_runs_a_shape_eagerly_until_it_is_hot(tiny_dirs):
    """The target's step graph: no graph for a shape's first two steps, its graph from the third."""
    llm = _llm(tiny_dirs, False, max_num_seqs=3)
    g, ran = llm.engine.runner.compiled, []
    forward = g.forward

    def spy(shape, ids, ctx):
        out = forward(shape, ids, ctx)
        if out is not None:  # ran through its graph (None: eager)
            ran.append(shape)
        return out

    g.forward = spy
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    from types import SimpleNamespace as NS

    decode = g.shape_for([NS(num_tokens=1, verify=False, seq=NS(capture=None))], NS(max_ctx=1), tree=False)
    assert ran and all(s == decode for s in ran)
    assert len(ran) == 5 - 2  # 5 decode steps after the prefill, the first two eager


def test_random_workload_compiled_with_preemption(tiny_dirs, heads):
    """Arrivals, aborts and preemption under a small KV budget, compiled: every finished request's tokens
    equal the eager engine's for it alone, and no block leaks."""
    sp = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=i)
          for i, (t, m) in enumerate([(0, 30), (0.9, 25), (0, 12), (1.0, 30)])]
    alone = [_llm(tiny_dirs, True, max_model_len=64).generate([p], [s])[0].outputs[0].token_ids
             for p, s in zip(PROMPTS, sp)]
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}
    e = _llm(tiny_dirs, False, spec, num_kv_blocks=24, max_num_seqs=4, max_model_len=64).engine
    got, aborted, preempted = random_workload(e, PROMPTS, sp, seed=1, abort_rate=0.02)
    assert preempted, "the workload never ran out of blocks"
    assert e.runner.blocks.num_free == e.runner.blocks.num_blocks
    assert e.runner.compiled.steps > 0
    for i in range(4):
        if i not in aborted:
            assert got[i] == alone[i], f"request {i}"


def test_a_step_that_compiles_reports_no_time(tiny_dirs):
    """The adaptive policy fits costs to step times: a step during which a graph compiled (seconds, not
    milliseconds, on this thread or beside it) reports none, and the steps after it do."""
    from tsengine.model import compile_worker
    llm = _llm(tiny_dirs, False, max_num_seqs=3)  # a batch bucket of its own: its graph is new in this process
    e, seen = llm.engine, []
    propose = e.proposer.propose

    def spy(proposal):
        seen.append((compile_worker.epoch(), proposal.target_seconds))
        return propose(proposal)

    e.proposer.propose = spy
    llm.generate(PROMPTS[:3], GREEDY)
    epochs = [c for c, _ in seen]
    fresh = [i for i in range(1, len(seen)) if epochs[i] != epochs[i - 1]]
    assert fresh, "no step compiled a graph"
    assert all(seen[i][1] == 0.0 for i in fresh)
    assert sum(t > 0 for i, (_, t) in enumerate(seen) if i > fresh[0] and i not in fresh) >= 10


def test_a_chain_step_padded_for_its_plain_requests_takes_the_graph(tiny_dirs, heads):
    """Adaptive speculation pads the windows of requests it does not draft for (`PAD`, tsengine/speculative/
    adaptive.py) so a chain step stays uniform: forced plans of one request drafting from the head and two
    padded run through the target's graph once hot, and the greedy tokens are plain decoding's."""
    from tsengine.speculative.adaptive.plan import PAD, Arm, Plan

    prompts, params = PROMPTS[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(tiny_dirs, True).generate(prompts, params)]
    spec = {"method": "auto", "model": str(heads["llama"]), "num_speculative_tokens": 1}
    llm = _llm(tiny_dirs, False, spec, max_num_seqs=3)
    e = llm.engine
    e.proposer.policy.choose = lambda st, found, remaining=None, queued=0, kept=None: Plan(Arm(1),
                                                                                ["eagle3"] + [PAD] * (len(st) - 1))
    graph_steps, propose = [], e.proposer.propose

    def spy(proposal):
        graph_steps.append(proposal.graph and proposal.prefill_rows == 0)
        return propose(proposal)

    e.proposer.propose = spy
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert e.proposer.policy.drafted_by[PAD] > 0
    assert sum(graph_steps) >= 3, graph_steps


def test_the_draft_graph_extends_and_chains_as_eager_does(tiny_dirs, heads):
    """A greedy step's one draft graph (the extension, then the whole chain: `DraftGraphs.extend_and_chain`)
    over runs of 1, 3 and 2 committed rows padded to a window of 4 and a batch of 4: the drafts equal the eager
    extension's and chain's, the KV writes too, and no draft slot changes but theirs and the scratch block's."""
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}
    eagle = _llm(tiny_dirs, False, spec).engine.proposer
    eagle.graphs.heat = Heat(after=1)  # compiled on first sight
    k_cache, v_cache = eagle.kv
    k_cache.normal_()
    v_cache.normal_()
    before, v_before = k_cache.clone(), v_cache.clone()
    runs = [([3, 4, 5], 9, 1), ([7], 1, 3), ([10, 11], 5, 2)]
    ids = [11, 22, 33, 44, 55, 66]
    aux = torch.randn(6, eagle.head.fc.weight.shape[1])
    got = eagle.graphs.extend_and_chain(runs, ids, aux, steps=3)
    assert ("draft", 4, 4, 256, 3) in eagle.graphs.graphs
    graph_k = k_cache.clone()
    k_cache.copy_(before)
    v_cache.copy_(v_before)
    eagle.graphs = None  # the eager path from here
    out, positions = eagle._extend(runs, ids, aux)
    last = torch.tensor([0, 3, 5])  # each run's last row
    tables = torch.tensor([[3, 4, 5], [7, 0, 0], [10, 11, 0]])
    want = eagle.greedy_chain(out[last], positions[last], tables, steps=3)
    assert got.tolist() == want.tolist()
    written = Context.build(runs, eagle.block_size, "cpu").slot_mapping.tolist()
    flat, eager_flat, flat0 = graph_k.flatten(0, 1), k_cache.flatten(0, 1), before.flatten(0, 1)
    torch.testing.assert_close(flat[written], eager_flat[written], atol=1e-4, rtol=1e-4)
    others = [s for s in range(scratch_slot([eagle.kv])) if s not in written]
    assert torch.equal(flat[others], flat0[others]), "a padding row or a chain step wrote outside the scratch block"


def test_a_graph_keeps_the_guards_on_its_inputs():
    """`compile_step` skips dynamo's module guards but keeps those on the call's inputs: a call with another
    input shape still gets a graph of its own (right values), not the first one's, and a bound tensor is read
    at each call."""
    w = torch.randn(8, 8)

    def matmul(weight, x):
        return x @ weight

    graph = compile_step(matmul, w, key=("guards", "test"))
    a, b = torch.randn(2, 8), torch.randn(5, 8)
    torch.testing.assert_close(graph(a), a @ w)
    torch.testing.assert_close(graph(b), b @ w)
    w.mul_(2)  # bound tensors are read at each call, not baked in
    torch.testing.assert_close(graph(a), a @ w)


def test_a_compiled_graph_is_called_without_dynamo_once_compiled():
    """After its first call, a graph of `compile_step` runs the bytecode dynamo made of it as a plain function
    (`graph_compiler.DirectGraph`): the same values as through dynamo, bound tensors read at each call, while a call
    of another shape or with autograd on still goes through dynamo (where its guards tell the shapes apart)."""
    w = torch.randn(8, 8)

    def matmul(weight, x):
        return x @ weight

    graph = compile_step(matmul, w, key=("direct", "test"))
    a = torch.randn(2, 8)
    with torch.no_grad():  # as the engine calls its graphs
        first = graph(a)
    assert graph.direct is not None
    through_dynamo = graph.compiled

    def refuse(*args):
        raise AssertionError("went through dynamo")

    graph.compiled = refuse
    with torch.no_grad():
        assert torch.equal(graph(a), first)
        w.mul_(2)
        torch.testing.assert_close(graph(a), a @ w)
        with pytest.raises(AssertionError, match="through dynamo"):
            graph(torch.randn(5, 8))
    with torch.enable_grad(), pytest.raises(AssertionError, match="through dynamo"):
        graph(a)
    graph.compiled = through_dynamo
    b = torch.randn(5, 8)
    torch.testing.assert_close(graph(b), b @ w)
