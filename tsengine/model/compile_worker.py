"""Step graphs compile off the engine thread: a step whose graph is not ready runs eagerly, and the next
step of its shape after the graph is ready runs through it. No request waits for a compile.

Why: one cold compile of the target's step is most of a minute on a 2-core CPU (inductor's lowering and
codegen, then g++ on the graph's C++ wrapper), and a compile on the engine thread stalls every request in
the batch for that long (issue 43: a fresh server's first requests waited 44-140 s, and a compile beside
other work stalled 32 streams past their clients' timeouts). An eager step of the same shape is slower by
a fraction, not by minutes (docs/benchmarks.md, "No request waits for a compile"). vLLM compiles every
shape before it serves instead; here that would be dozens of shapes at most of a minute each.

How:
- One daemon thread per process compiles one graph at a time, in the order its shapes became hot, niced
  (Linux nice is per thread, and g++ inherits it) so the engine's own threads keep the cores. Inductor
  compiles on that thread alone (`compile_threads` 1: its worker pool would not be niced), and the GIL
  changes hands every 0.2 ms while a compile runs, so the engine thread waits less for it between ops.
  Measured on 2 cores: the longest step beside a cold compile fell from 5.3 s to 1.6 s
  (docs/benchmarks.md, "No request waits for a compile").
- The compile is the graph's first call (dynamo compiles inside it), made with a copy of the step's
  inputs whose KV writes go to the scratch slot, which nobody reads; its reads of the live cache race the
  engine's writes and its outputs are dropped.
- A graph is `ready` only after that call returned; the engine thread then calls it as before
  (`graph_compiler.DirectGraph`). A compile that fails leaves its shape eager for good, with a warning.
- While a compile runs, step timings say nothing about a plan's cost (the compile shares the cores):
  `epoch()` changes at every compile's start and end and is odd while one runs, so timing consumers (the
  adaptive policy, `metrics.StepClock`) skip those steps.
- A server's compiles wait for a moment its engine is idle (`IDLE_S` without a step), at most
  `idle_wait_s` (`SERVER_IDLE_WAIT_S` once the server is warm): a compile shares the cores and the GIL
  with the steps it overlaps, and an adaptive server whose chains met new shapes under load compiled during
  timed rounds at 0.8x its speed without one (docs/benchmarks.md, "Adaptive speculation by default").
  Under sustained load a compile still starts once it has waited that long. Offline engines (`LLM`, the
  recipe's eval) compile at once: they gain from a graph as soon as it is ready, and are never idle.
- `TSENGINE_GRAPH_COMPILE=inline` compiles on the caller's thread at once, as before: for tests that must
  prove a graph ran, and benchmarks that time graphs from their first step.
- The compiled code is cached on disk under the tsengine cache (`use_persistent_cache`), so a restart
  loads a known shape in seconds; temp cleaners and reboots wipe torch's default (the system temp dir).
"""

from __future__ import annotations

import builtins
import functools
import gc
import hashlib
import logging
import os
import platform
import queue
import sys
import threading
import time
import weakref

import torch

log = logging.getLogger("tsengine")
MODES = ("background", "inline")
NICE = 19
SWITCH_INTERVAL_S = 2e-4  # the GIL's hand-over interval while a compile runs (Python's default: 5 ms)
IDLE_S = 0.5  # no engine step for this long: the engines are idle, a compile may start
SERVER_IDLE_WAIT_S = 20.0  # the most a server's compile waits for an idle moment


def mode() -> str:
    value = os.environ.get("TSENGINE_GRAPH_COMPILE", "background")
    if value not in MODES:
        from tsengine.errors import UserError

        raise UserError(f"TSENGINE_GRAPH_COMPILE={value!r}: allowed values are {', '.join(MODES)}")
    return value


def use_persistent_cache() -> str:
    """Point inductor's cache (its FX graph cache and compiled code) at <tsengine cache>/inductor/<machine>,
    unless the user chose a directory (TORCHINDUCTOR_CACHE_DIR). Keyed by torch version and CPU flags:
    this cache may outlive the machine's CPU model, and code built for AVX-512 must not load on an
    AVX2-only CPU. Torch writes its own default (the system temp dir) into the environment the first time
    it asks (some import does), so that value counts as unset; call this before anything compiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        from torch._inductor.utils import clear_caches

        from tsengine.targets import cache_root

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor" / machine_tag())
        clear_caches()  # paths torch memoized under the old directory
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def machine_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    digest = hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]
    return f"torch-{torch.__version__}-{platform.machine()}-{digest}"


def raise_recompile_limits() -> None:
    """Every graph is a recompile of torch.compile's one wrapper frame (`graph_compiler.compile_step`), and
    past dynamo's limit (8) a new shape would silently stay eager. Dynamo's config is per thread: the
    engine thread and the worker each set it."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 256)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)


def scratch_copy(inputs: tuple, slots: int | None, scratch: int) -> tuple:
    """A graph's compile inputs: a copy of a step's, with input `slots` (the KV slots it writes; None: it
    writes none) all pointing at the scratch slot, which nobody reads. The step's own tensors stay the
    step's: the compile runs later, on another thread."""
    return tuple(None if x is None else torch.full_like(x, scratch) if i == slots else x.clone()
                 for i, x in enumerate(inputs))


class CompileWorker:
    """The process's compile queue (one per process: graphs of several engines share the cores)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self.pending = 0  # submitted, not finished
        self.compiled = 0  # ready graphs (compiled, or loaded from the cache on disk)
        self.failed = 0
        self.loaded = 0  # of the compiled, those found in the compile cache on disk (a restart's)
        self._epoch = 0
        self.idle_wait_s = 0.0  # the most a compile waits for the engines to be idle (0: it starts at once)
        self.busy_at = 0.0  # when an engine last ran a step (`busy`)

    def busy(self) -> None:
        """An engine runs a step (called every step: a compile waits for a moment without one)."""
        self.busy_at = time.monotonic()

    def submit(self, graph, inputs: tuple, name: str) -> None:
        """Compile `graph` by calling it once with `inputs` (their KV writes must go to the scratch slot):
        at once on this thread in inline mode, else on the worker thread."""
        graph.state = "queued"
        if mode() == "inline":
            self._compile(graph, inputs, name)
            return
        with self._lock:
            self.pending += 1
            if self._thread is None:
                _fx_patches_on_the_tracing_thread_only()
                self._thread = threading.Thread(target=self._run, name="tsengine-compile", daemon=True)
                self._thread.start()
        self._queue.put((weakref.ref(graph), inputs, name, time.monotonic()))  # an engine dropped meanwhile:
        # nothing to compile

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no compile is pending (benchmarks, after their warm-up); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self.pending == 0, timeout)

    def epoch(self) -> int:
        return self._epoch

    def _run(self) -> None:
        try:  # Linux: nice applies to this thread (and the compilers it spawns), not the process
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        from torch._inductor import config as inductor

        inductor.compile_threads = 1
        raise_recompile_limits()
        while True:
            ref, inputs, name, queued_at = self._queue.get()
            self._until_idle(queued_at)
            graph = ref()
            if graph is not None:  # None: its engine is gone (an eval's engine per shape, say)
                default = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
                try:
                    self._compile(graph, inputs, name)
                finally:
                    sys.setswitchinterval(default)
            del graph, inputs  # the engine's model is free to go
            if not self._queue.empty():  # a dropped engine's graphs reach each other through their bound
                gc.collect()  # modules (a cycle): collect it before the next job's weakref is read (~0.1-0.4 s)
            with self._lock:
                self.pending -= 1
                self._lock.notify_all()

    def _until_idle(self, queued_at: float) -> None:
        """Wait for `IDLE_S` without an engine step, or until `idle_wait_s` after `queued_at`."""
        while True:
            now = time.monotonic()
            if now - self.busy_at >= IDLE_S or now - queued_at >= self.idle_wait_s:
                return
            time.sleep(0.05)

    def _compile(self, graph, inputs: tuple, name: str) -> None:
        self._epoch += 1
        t0, misses = time.perf_counter(), _cache_misses()
        try:
            with torch.no_grad():
                graph(*inputs)
        except Exception as e:  # the shape stays eager; a request never fails for a compile
            graph.state, self.failed = "failed", self.failed + 1
            log.warning("compiling the %s graph failed, its steps stay eager: %s: %s", name, type(e).__name__, e)
        else:
            graph.state, self.compiled = "ready", self.compiled + 1
            cached = _cache_misses() == misses
            self.loaded += cached
            log.info("%s the %s graph in %.1f s%s", "loaded" if cached else "compiled", name,
                     time.perf_counter() - t0, "" if mode() == "inline" else " (off the engine thread)")
        finally:
            self._epoch += 1


def _cache_misses() -> int:
    """Lookups in torch's compile caches on disk (AOT autograd's, inductor's FX graph cache) that found
    nothing: a compile that adds none loaded its graph instead of compiling it."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_miss"] + counters["inductor"]["fxgraph_cache_miss"]


def _fx_patches_on_the_tracing_thread_only() -> None:
    """torch.fx's symbolic tracer (which AOT autograd and inductor's pattern matcher use inside a compile)
    patches process-wide names while it traces: `nn.Module.__call__`, `__getattr__` and free functions.
    An eager step on the engine thread that calls a module meanwhile lands in the tracer and fails
    ("module is not installed as a submodule", seen). Each patch here applies on the thread that made it;
    every other thread keeps the original."""
    from torch.fx import _symbolic_trace as fx

    if getattr(fx._Patcher, "_tsengine_thread_local", False):
        return
    patch, patch_method = fx._Patcher.patch, fx._Patcher.patch_method

    def only_here(new_fn, old_fn):
        owner = threading.get_ident()

        @functools.wraps(new_fn)
        def fn(*args, **kwargs):
            return (new_fn if threading.get_ident() == owner else old_fn)(*args, **kwargs)
        return fn

    def thread_patch(self, frame_dict, name, new_fn, deduplicate=True):
        old_fn = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
        return patch(self, frame_dict, name, only_here(new_fn, old_fn), deduplicate)

    def thread_patch_method(self, cls, name, new_fn, deduplicate=True):
        return patch_method(self, cls, name, only_here(new_fn, getattr(cls, name)), deduplicate)

    fx._Patcher.patch, fx._Patcher.patch_method = thread_patch, thread_patch_method
    fx._Patcher._tsengine_thread_local = True


WORKER = CompileWorker()


def epoch() -> int:
    """Changes when a compile starts or ends, odd while one runs: a step timed across a change (or while it
    is odd) shared the cores with a compile."""
    return WORKER.epoch()


def quiet(start_epoch: int) -> bool:
    """No compile ran at any time since `start_epoch = epoch()` was read."""
    return start_epoch % 2 == 0 and epoch() == start_epoch
