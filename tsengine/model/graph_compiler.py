"""Compiling one static-shape step, and calling it without dynamo once compiled: the graph bank's
(`tsengine/model/graphs.py`) way to turn a step function and the modules and tensors it is bound to into a callable
whose per-call cost is the compiled code's own."""

from __future__ import annotations

import functools
import threading
import types

import torch
from torch._dynamo import external_utils


def compile_step(fn, *bound, key: tuple) -> "DirectGraph":
    """`fn` with `bound` as its first arguments, compiled for one shape without dynamo's guards on modules,
    and once compiled called without dynamo at all (`DirectGraph`).

    Why: dynamo checks its compiled entries in turn on every call, each against a guard per parameter and
    cache tensor: a visible share of a batch-1 step with every shape's entry guarding all of them, a fraction
    of that with the module guards skipped, and nothing once the call bypasses dynamo (torch profiler;
    measured: docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"). Each graph gets its own copy of
    `fn`, named for its `key`: torch.compile puts every partial's entries on one shared wrapper frame
    (`external_utils.wrap_inline`), where the guard on the partial's function is what tells two engines'
    graphs of one shape apart (`test_engines_of_one_shape_each_run_their_own_weights`; the FX graph cache on
    disk keys on the graph, not the name). Skipping the module guards is safe here because that copy is only
    ever called with the module and cache tensors bound below, and the bank picks the graph by shape; the
    inputs' shape and dtype guards stay for the first call (vLLM skips the guards altogether)."""
    name = "_".join([fn.__name__, *map(str, key)])
    private = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                                 fn.__closure__)
    step = functools.partial(private, *bound)
    return DirectGraph(step, torch.compile(step, fullgraph=True, dynamic=False, options={
        "cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}))


_compiling = threading.local()  # .graphs: the graphs whose first call runs on this thread (dynamo compiles inside)


def _keep_rewritten(code: types.CodeType, new_code: types.CodeType) -> None:
    graphs = getattr(_compiling, "graphs", None)
    if graphs and graphs[-1].rewritten is None:
        graphs[-1].rewritten = new_code


torch._dynamo.convert_frame.register_bytecode_hook(_keep_rewritten)


def _signature(inputs) -> tuple:
    """What dynamo's guards on a call's inputs and global state check, for the graphs here."""
    return torch.is_grad_enabled(), *((x.shape, x.dtype, x.stride()) if isinstance(x, torch.Tensor) else x
                                      for x in inputs)


class DirectGraph:
    """A compiled step called the way vLLM calls its compiled model: after the first call has compiled it,
    through the bytecode dynamo made of the step (which calls the compiled graph) as a plain function, so no
    call pays for dynamo's frame hook, cache lookup and guards. On the draft graph at batch 1 that cut most of
    the time between the call and the compiled graph's own code, and drafting's share of a step with it
    (measured: docs/benchmarks-journal.md, "The few-row kernel on panels, and graphs called without dynamo").
    Safe because what the guards checked holds by construction: the bound modules and tensors are this
    graph's own, and a call whose inputs differ from the compiled ones in shape, dtype or stride, or that
    runs with autograd on (the engine never does), goes back through dynamo, guards included.

    What dynamo rewrote is torch.compile's wrapper around the partial (`external_utils.wrap_inline`, a frame
    with the partial in its closure), not the step itself: compiling the step as a function of all its
    arguments instead gave slower code (the target's batch-1 step, measured), so the graphs stay as they
    were and only the way in changes."""

    def __init__(self, step: functools.partial, compiled):
        self.step, self.compiled = step, compiled
        self.rewritten: types.CodeType | None = None
        self.direct, self.signature = None, None
        self.state = "new"  # then queued, ready or failed (tsengine/model/compile_worker.py)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def __call__(self, *inputs):
        if self.direct is not None and _signature(inputs) == self.signature:
            return self.direct(*inputs)
        if not hasattr(_compiling, "graphs"):
            _compiling.graphs = []
        _compiling.graphs.append(self)
        try:
            out = self.compiled(*inputs)
        finally:
            _compiling.graphs.pop()
        if self.direct is None and self.rewritten is not None:
            self.direct, self.rewritten = self._plain(self.rewritten), None
            self.signature = _signature(inputs)
        return out

    def _plain(self, code: types.CodeType):
        """The rewritten frame as a function; None if it is not the wrapper's frame this class knows."""
        inner = external_utils.wrap_inline(self.step)
        if code.co_freevars != inner.__code__.co_freevars or code.co_filename != inner.__code__.co_filename:
            return None
        return types.FunctionType(code, inner.__globals__, inner.__name__, None, inner.__closure__)
