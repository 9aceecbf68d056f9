"""Plain helpers shared by several test modules (no fixtures: those live in conftest.py, where pytest
finds them without an import; the tiny-target builders are in tiny.py, the test-only oracles in oracles.py).

Test modules import from here, never from conftest.py or from one another (tests/test_layers.py checks it).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn

from tsengine.eagle3.config import Eagle3Config
from tsengine.eagle3.head import Eagle3Head
from tsengine.eagle3.vocab import vocab_map
from tsengine.engine.core import Engine
from tsengine.entrypoints.llm import LLM
from tsengine.entrypoints.openai.app import build_app
from tsengine.entrypoints.openai.async_engine import AsyncEngine
from tsengine.entrypoints.openai.guards import header_deadline_protocol
from tsengine.entrypoints.openai.settings import ServerSettings
from tsengine.infer.reference import DraftTree, compare_to_greedy
from tsengine.sampling_params import SamplingParams


# ---- heads ----------------------------------------------------------------------------------------------------
def random_head(model, seed: int = 0, draft_vocab_size: int | None = None, counts=None) -> Eagle3Head:
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab_size)
    head = Eagle3Head(cfg)
    head.init_weights(seed)
    head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, counts))
    head.bind_embeddings(model.get_input_embeddings().weight)
    return head.eval()


# ---- the engine on a tiny target (tests/test_engine.py and the modules that compare against it) ----------------
PROMPTS = [[5, 17, 33, 2, 9, 100, 41, 7, 8, 9, 10], [7, 8, 9], list(range(40, 75)), [300, 12] * 9]


def make_llm(tiny_dirs, kind="llama", head=None, steps=3, **kw):
    kw = {"debug_checks": True, "block_size": 4, "max_num_batched_tokens": 16, **kw}
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": steps} if head else None
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


# ---- the reference generator ----------------------------------------------------------------------------------
def assert_lossless(model, prompt, spec_tokens, greedy):
    verdict = compare_to_greedy(model, prompt, spec_tokens, greedy)
    if verdict.status == "near-tie":
        pytest.skip(f"reported near-tie, not a failure: {verdict}")  # visible in -ra output, never silent
    assert verdict.status == "match", str(verdict)


class ScriptedDrafter:
    """Proposes random trees in which the true greedy continuation runs exactly `depth` levels deep.

    Acceptance is then known in advance: `depth` nodes + the bonus. If tree masks, positions or the
    acceptance walk were wrong, either the accept counts or the output would differ.
    """

    def __init__(self, prompt, greedy, shape, vocab, seed):
        self.prompt, self.greedy, self.shape, self.vocab = prompt, greedy, shape, vocab
        self.rng = random.Random(seed)
        self.expected: list[int] = []

    def __call__(self, tokens, feats):
        assert feats.shape[0] == len(tokens) - 1  # features for every committed token but the root
        n = self.shape.num_draft_tokens - 1
        parents = [-1]
        for i in range(1, n):  # random tree, parents before children, depth <= steps
            parents.append(self.rng.choice([-1] + [j for j in range(i) if _depth(parents, j) < self.shape.steps]))
        tree = DraftTree([0] * n, parents)
        j = len(tokens) - len(self.prompt)  # greedy[j] is the token after the root
        truth = self.greedy[j:] + [None] * 64
        target_node = self.rng.randrange(n)
        path = _path(parents, target_node)
        depth = self.rng.randint(0, len(path))
        on_path = {node: d for d, node in enumerate(path, start=1)}
        for i in range(n):
            d = tree.depths[i]
            if i in on_path and on_path[i] <= depth:
                tree.tokens[i] = truth[d - 1]
            else:
                tree.tokens[i] = self.rng.choice([t for t in range(self.vocab) if t != truth[d - 1]])
        self.expected.append(depth + 1)
        return tree


def _depth(parents, j):
    d = 1
    while parents[j] >= 0:
        j, d = parents[j], d + 1
    return d


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


# ---- statistics -----------------------------------------------------------------------------------------------
def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's χ² test: survival function of χ²(k - 1) = the regularized upper incomplete gamma."""
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


# ---- training data --------------------------------------------------------------------------------------------
WORDS = "the water one number how long two people call first who may down side been now find".split()


def write_rows(path: Path, n: int, seed: int, with_answers: bool) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))}]
            if with_answers:
                msgs.append({"role": "assistant",
                             "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))})
            f.write(json.dumps({"id": f"r{seed}-{i}", "messages": msgs}) + "\n")
    return path


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

    def rewrite(self, seqs: list, drafts: list) -> list:
        raise NotImplementedError


# ---- the server on a loopback port (tests/test_server*.py) ---------------------------------------------------
@contextlib.contextmanager
def serving(config, model_name: str, api_key: str | None, **settings):
    """`build_app` behind uvicorn on a free loopback port, the engine built on its own thread as
    `tsengine serve` builds it."""
    engine = AsyncEngine(lambda: Engine(config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server_settings = ServerSettings(model_name=model_name, api_key=api_key, **settings)
    app = build_app(engine, server_settings)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                       http=header_deadline_protocol(server_settings.header_timeout_s)))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield SimpleNamespace(url=url, engine=engine.engine, async_engine=engine, completions=app.state.server,
                              port=sock.getsockname()[1],
                              client=openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0,
                                                   timeout=30))
    finally:
        uv.should_exit = True
        thread.join(10)
        engine.shutdown()
        sock.close()


def post(server, path: str, body, key: str | None = "sk-test", headers: dict | None = None, **kw) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    kw = {"json": body} if "content" not in kw else kw
    return httpx.post(server.url + path, headers=headers, timeout=30, **kw)


def wait_idle(engine, timeout: float = 10.0) -> None:
    """The engine has no request left and every KV block is free again."""
    blocks, deadline = engine.runner.blocks, time.monotonic() + timeout
    while engine.has_unfinished() or blocks.num_free != blocks.num_blocks:
        assert time.monotonic() < deadline, (f"{blocks.num_blocks - blocks.num_free} blocks still held, "
                                             f"unfinished={engine.has_unfinished()}")
        time.sleep(0.02)


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.05):
    """Every engine step takes at least `seconds`: a long request is surely still running when the client
    leaves, so finishing early proves the abort."""
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.step = step
    try:
        yield
    finally:
        del engine.step


