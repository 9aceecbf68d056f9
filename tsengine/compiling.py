"""When a step graph compiles (tsengine/graphs.py holds the graphs and their shapes).

Graphs compile lazily, once their shape is hot (`Heat`: its `HOT_AFTER`-th step within `HOT_WINDOW` graph
steps; until then it runs eagerly), and are logged with their compile time; torch's FX graph cache keeps
them on disk, so a restart recompiles a known shape in seconds, not ~40 s. Why not on the first step: a
compile stalls every request in the batch for ~40 s, and a shape met once (an adaptive server's exploration
step, one step in 128 at 16 requests) never earns that back: compiled on first sight, exploration stalled
two of three timed rounds of a 16-request benchmark (7.8 and 71.7 tok/s against 132 without a compile,
docs/benchmarks.md). A shape a fixed configuration runs is hot after two eager steps.

A hot shape compiles off the step path (`Compiler`): a worker thread compiles its graph and runs it once on
inputs that write only the scratch block, and the steps go on eagerly until it is published. Compiled on
the step that made it hot, a graph stalled every request in the batch for its whole compile: an adaptive
server's timed round at 4 requests took 82 s instead of 19 (one compile, docs/benchmarks.md).
`TSENGINE_COMPILE_IN_BACKGROUND=0` compiles on that step instead (the tests that count eager steps).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("tsengine")

HOT_AFTER = 3  # a shape compiles on its third step within HOT_WINDOW graph-eligible steps
HOT_WINDOW = 64
_compiles = 0  # graphs compiled (or loaded from torch's cache) in this process, started or done
_in_flight = 0  # graphs compiling on a worker thread now


def compiles() -> int:
    """How many graphs this process has started compiling so far."""
    return _compiles


def compiling() -> int:
    """How many graphs are compiling in the background now."""
    return _in_flight


def undisturbed(compiles_before: int) -> bool:
    """No graph compiled since `compiles()` read `compiles_before`, and none is compiling: a step that
    compiled one took seconds, and one run beside a background compile shared the CPU with it, so timing
    consumers (the engine's step time, the adaptive policy's cost lines) skip it."""
    return _compiles == compiles_before and _in_flight == 0


def allow_a_graph_per_shape() -> None:
    """One graph per shape, and never a dynamic one: a shape change is a new graph, not a recompile of the
    last one with symbolic sizes (measured slower: tsengine/graphs.py); every graph of an engine is a compile of the same function,
    so dynamo's per-function limits go up. Torch's config is per thread: the compile worker sets it too."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


class Compiler:
    """Compiles the graphs of hot shapes (one per engine, shared by the target's and the head's graphs): on
    a worker thread by default (see the module docstring), else on the step that asks."""

    def __init__(self, background: bool | None = None):
        if background is None:
            background = os.environ.get("TSENGINE_COMPILE_IN_BACKGROUND", "1") != "0"
        self.background = background
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="tsengine-compile", initializer=allow_a_graph_per_shape)
                        if background else None)
        self._pending: set = set()  # keys compiling now, or whose compile failed (they stay eager)

    def graph(self, key, graphs: dict, seconds: dict, what: str, fn, dummy):
        """`graphs[key]`, compiled from `fn` now (inline) or in the background (None until it is published);
        `dummy()`: inputs of the shape that write only the scratch block, for the background's first run."""
        graph = graphs.get(key)
        if graph is not None or key in self._pending:
            return graph
        if not self.background:
            return self.inline(key, graphs, fn)
        graph = self.inline(key, {}, fn)
        self._pending.add(key)
        self._worker.submit(self._warm, key, graphs, seconds, what, graph, dummy)
        return None

    @staticmethod
    def inline(key, graphs: dict, fn):
        """`key`'s graph, to be compiled by its first call (on the caller's thread, who times it)."""
        global _compiles
        _compiles += 1
        graph = graphs[key] = torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
        return graph

    def _warm(self, key, graphs: dict, seconds: dict, what: str, graph, dummy) -> None:
        global _in_flight
        _in_flight += 1
        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # the engine's step runs without grad: the guards must match
                graph(*dummy())
        except Exception:  # the shape stays eager; serving goes on
            log.exception("compiling the %s graph failed; that shape runs eagerly", what)
            return
        finally:
            _in_flight -= 1
        seconds[key] = time.perf_counter() - t0
        log.info("compiled the %s graph in %.1f s (in the background)", what, seconds[key])
        graphs[key] = graph  # published: the next step of this shape runs it
        self._pending.discard(key)

    def wait(self) -> None:
        """Until every compile asked for so far is done (benchmarks, before their clocks start)."""
        if self._worker is not None:
            self._worker.submit(lambda: None).result()


class Heat:
    """Which shapes are worth a compile: those met `after` times within the last `window` graph-eligible
    steps (the clock ticks once per target step that fits a graph). One per engine, shared by the target's
    and the head's graphs, so both count in target steps."""

    def __init__(self, after: int = HOT_AFTER, window: int = HOT_WINDOW):
        self.after, self.window, self.clock = after, window, 0
        self._seen: dict[object, list[int]] = {}

    def tick(self) -> None:
        self.clock += 1

    def hot(self, key) -> bool:
        """Records one step of `key`'s shape; True once it has been met `after` times lately."""
        recent = [t for t in self._seen.get(key, ()) if self.clock - t < self.window] + [self.clock]
        self._seen[key] = recent[-self.after:]
        return len(recent) >= self.after
