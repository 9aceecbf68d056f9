"""Graphs compiled off the engine thread (tsengine/model/compile_worker.py): steps never wait for a compile,
the switch from eager to graph changes no token, a failed compile leaves its shape eager, torch.fx's
patches stay on the tracing thread, the warm-up compiles a first request's graphs, and the compiled code
is cached under the tsengine cache."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers.engine import PROMPTS, make_llm
from tsengine.model import compile_worker
from tsengine.model.compile_worker import WORKER
from tsengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def background(monkeypatch):
    monkeypatch.setenv("TSENGINE_ENFORCE_EAGER", "0")
    monkeypatch.setenv("TSENGINE_GRAPH_COMPILE", "background")


def _tokens(llm, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [params] * len(PROMPTS))]


def test_steps_run_eagerly_while_their_graph_compiles_then_switch(tiny_dirs, heads, background, monkeypatch):
    """A compile held back on the worker thread: the engine finishes every request eagerly meanwhile (no step
    waits), then runs the same requests through the graphs once they are ready, token for token as the eager
    engine, greedy and seeded, chain drafts included."""
    release, compile_ = threading.Event(), WORKER._compile

    def held(graph, inputs, name):
        release.wait(120)
        compile_(graph, inputs, name)

    monkeypatch.setattr(WORKER, "_compile", held)
    seeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=7)
    eager = make_llm(tiny_dirs, head=heads["llama"], max_num_seqs=3, enforce_eager=True)
    llm = make_llm(tiny_dirs, head=heads["llama"], max_num_seqs=3)
    runner = llm.engine.runner
    want = _tokens(eager), _tokens(eager, seeded)
    try:
        assert (_tokens(llm), _tokens(llm, seeded)) == want
        assert runner.compiled.steps == 0 and WORKER.pending > 0, "no shape went to the worker"
        assert {g.state for g in runner.compiled.graphs.values()} == {"queued"}
    finally:
        release.set()
    assert WORKER.wait(300)
    assert all(g.ready for g in runner.compiled.graphs.values())
    assert (_tokens(llm), _tokens(llm, seeded)) == want
    assert runner.compiled.steps > 0


class _Broken:
    """A graph whose compile (its first call) raises."""
    state = "new"
    ready = property(lambda self: self.state == "ready")

    def __call__(self, *inputs):
        raise RuntimeError("inductor could not lower this")


def test_a_graph_that_fails_to_compile_leaves_its_shape_eager(tiny_dirs, background, monkeypatch):
    """The request still finishes with the eager engine's tokens; the failure is counted, not raised."""
    from tsengine.model import graphs

    monkeypatch.setattr(graphs, "compile_step", lambda *bound, key: _Broken())
    failed = WORKER.failed
    want = _tokens(make_llm(tiny_dirs, enforce_eager=True))
    llm = make_llm(tiny_dirs, max_num_seqs=2)
    assert _tokens(llm) == want
    assert WORKER.wait(60)
    assert WORKER.failed > failed
    assert _tokens(llm) == want and llm.engine.runner.compiled.steps == 0


def test_fx_patches_stay_on_the_tracing_thread():
    """While torch.fx traces on one thread, a module called on another runs as itself. Without the shim the
    second call lands in the tracer: "module is not installed as a submodule" (seen in a server)."""
    compile_worker._fx_patches_on_the_tracing_thread_only()
    inside, leave = threading.Event(), threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x):
            inside.set()
            leave.wait(30)
            return x + 1

    class Traced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.waits = torch.nn.Linear(2, 2), Waits()

        def forward(self, x):
            return self.waits(self.inner(x))  # traced through: it holds the trace open

    errors: list[BaseException] = []

    def trace():
        try:
            torch.fx.symbolic_trace(Traced())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=trace)
    t.start()
    try:
        assert inside.wait(30)
        other = torch.nn.Sequential(torch.nn.Linear(2, 2))  # not the traced root's
        assert other(torch.ones(1, 2)).shape == (1, 2)
    finally:
        leave.set()
        t.join(30)
    assert not errors, errors


def test_warm_up_compiles_a_first_requests_graphs(tiny_dirs, heads, background):
    """After `Engine.warm_up` the first request runs every decode/verify step through a ready graph, and the
    counters show no warm-up request."""
    llm = make_llm(tiny_dirs, head=heads["llama"])
    e = llm.engine
    assert e.warm_up(timeout=300)
    assert e.stats.requests_started == 0 and e.stats.generated_tokens == 0
    graphs_before = e.runner.compiled.steps
    assert graphs_before > 0 or all(g.ready for g in e.runner.compiled.graphs.values())
    out = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens
    verify_steps = e.stats.num_drafts
    assert e.runner.compiled.steps - graphs_before == verify_steps > 0, "a verify step ran eagerly"


def test_the_compile_cache_lives_under_the_tsengine_cache(monkeypatch, tmp_path):
    """Unless the user chose a directory: torch's default is the system temp dir, which cleaners wipe."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TSENGINE_CACHE", str(tmp_path))
    for unset in (None, default_cache_dir()):  # torch writes its default into the environment on first use
        if unset is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", unset)
        path = compile_worker.use_persistent_cache()
        assert path.startswith(str(tmp_path / "inductor")) and torch.__version__ in path
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_worker.use_persistent_cache() == str(tmp_path / "mine")


def test_a_bad_compile_mode_is_refused_by_name(monkeypatch):
    from tsengine.errors import UserError

    monkeypatch.setenv("TSENGINE_GRAPH_COMPILE", "sometimes")
    with pytest.raises(UserError, match="TSENGINE_GRAPH_COMPILE.*background, inline"):
        compile_worker.mode()


_RESTART = """
import sys
from tsengine.entrypoints.llm import LLM
from tsengine.model.compile_worker import WORKER
from tsengine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], block_size=4, max_num_batched_tokens=16)
llm.engine.warm_up(timeout=600)
print("COUNTS", WORKER.compiled, WORKER.loaded)
"""


def test_a_restart_loads_its_graphs_from_the_cache_on_disk(tiny_dirs, tmp_path):
    """The warm-up's graphs, compiled by one process under the tsengine cache, are loaded by the next."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TSENGINE_CACHE=str(tmp_path), TSENGINE_ENFORCE_EAGER="0", TSENGINE_GRAPH_COMPILE="background")
    counts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _RESTART, str(tiny_dirs["llama"])], env=env, text=True,
                             capture_output=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        compiled, loaded = map(int, out.stdout.split("COUNTS")[1].split())
        counts.append((compiled, loaded))
    assert counts[0][0] > 0 and counts[0][1] == 0, counts  # a new cache: compiled
    assert counts[1] == (counts[0][0], counts[0][0]), counts  # the restart: every graph loaded
    assert (tmp_path / "inductor").is_dir()


def test_graphs_of_a_dropped_engine_are_not_compiled(tiny_dirs, heads, background, monkeypatch):
    """An engine dropped while its graphs wait for the worker (an eval builds one engine per shape) costs no
    compile: the worker skips them, and nothing of the engine is kept alive by the queue."""
    import gc

    release, compiled, compile_ = threading.Event(), [], WORKER._compile

    def held(graph, inputs, name):
        compiled.append(name)
        release.wait(120)
        compile_(graph, inputs, name)

    monkeypatch.setattr(WORKER, "_compile", held)
    llm = make_llm(tiny_dirs, head=heads["llama"], max_num_seqs=3)
    _tokens(llm)
    queued = len(llm.engine.runner.compiled.graphs) + len(llm.engine.proposer.graphs.graphs)
    assert queued >= 2
    del llm
    gc.collect()
    release.set()
    assert WORKER.wait(300)
    assert len(compiled) == 1, compiled  # the one already on the worker when the engine went


class _Timed:
    """A graph whose compile (its first call) only notes when it ran."""
    state = "new"
    ran_at: float | None = None

    def __call__(self, *inputs):
        import time

        self.ran_at = time.monotonic()


@pytest.mark.parametrize("wait_s", [5.0, 0.3])
def test_a_servers_compile_waits_for_an_idle_moment_at_most_its_wait(background, wait_s):
    """Steps every 20 ms for 1.2 s, a compile queued at their start: it starts once the steps stop (`IDLE_S`
    later), or once it has waited `idle_wait_s` if that comes first (sustained load still compiles)."""
    import time

    worker, graph = compile_worker.CompileWorker(), _Timed()
    worker.idle_wait_s = wait_s
    worker.busy()
    start = time.monotonic()
    worker.submit(graph, (), "timed")
    while time.monotonic() - start < 1.2:
        worker.busy()
        time.sleep(0.02)
    stopped = time.monotonic()
    assert worker.wait(30) and graph.state == "ready"
    if wait_s > 1.2:
        assert graph.ran_at >= stopped + compile_worker.IDLE_S - 0.05
    else:
        assert start + wait_s - 0.05 <= graph.ran_at < stopped


def test_offline_engines_compile_at_once(background):
    """`idle_wait_s` 0 (every engine but a warm server's): a compile starts while steps run."""
    import time

    worker, graph = compile_worker.CompileWorker(), _Timed()
    worker.busy()
    start = time.monotonic()
    worker.submit(graph, (), "timed")
    while graph.ran_at is None and time.monotonic() - start < 10:
        worker.busy()
        time.sleep(0.02)
    assert graph.ran_at is not None and graph.ran_at - start < 0.5
