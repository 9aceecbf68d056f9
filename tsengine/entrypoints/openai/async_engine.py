"""The Engine behind an asyncio server: one thread owns it, coroutines talk to it through queues.

The Engine is not thread-safe and `step()` blocks for a whole forward pass, so it cannot run on the event
loop. A dedicated thread owns it and loops: apply the queued commands (add, abort) in the order they were
sent, run `step()` while any request has work, and otherwise sleep on the command queue. Each request's
outputs go to its own `asyncio.Queue`, handed over with `loop.call_soon_threadsafe`, so the loop never
waits on the engine and the engine never waits on a slow client.

Aborts travel through the same FIFO as adds, so an abort sent while its add is still queued is applied
after it: a consumer that goes away at any moment (client disconnect, cancelled task) frees its blocks.
A step that fails because of one request's data stops that request alone (tsengine/engine/faults.py): its
stream gets an output with finish_reason "error". Only an engine-wide failure (`EngineFault`, or a bug
outside the step) fails every open request with `EngineError` (no client waits forever); the trace is
logged once, and the requests are dropped from the engine; if even that fails the engine is marked dead
and later requests fail at once. The error clients see names no internals: the log has them.

Give a factory rather than an Engine and the engine is built on its own thread. On CPU that matters:
libgomp throttles its workers' spin-wait as soon as more threads sit in OpenMP pools than there are cores,
so a model loaded on the main thread and stepped on another decodes far slower on 2 cores (measured:
docs/benchmarks-journal.md, "Server throughput (issue 4)"). Built and stepped on one thread, the process
has one pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from tsengine.engine import Engine, StepOutput
from tsengine.sampling_params import SamplingParams

log = logging.getLogger("tsengine")

_STOP = object()


class EngineError(RuntimeError):
    """The engine failed while serving the request (a bug, not the user's input); the trace is in the log."""


class RequestStream:
    """One request's outputs, in order; ends after the output with `finished=True`.

    `abort()` is idempotent and a no-op once the request finished; servers call it in a `finally` so every
    way out (stop string, disconnect, error) releases the engine's request."""

    def __init__(self, owner: "AsyncEngine", request_id: str, outputs: asyncio.Queue):
        self.owner, self.request_id, self._outputs = owner, request_id, outputs
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine]):
        """`engine`: an Engine, or a zero-argument factory called on the engine thread (its error, such
        as a `UserError` for a bad config, is raised here)."""
        self.engine = engine if isinstance(engine, Engine) else None
        self.dead: EngineError | None = None  # set when the thread stops serving (shutdown or a failure)
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (loop, queue); touched only on the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(None if self.engine else engine, ready),
                                        name="tsengine-engine", daemon=True)
        self._thread.start()
        try:
            ready.result()  # the factory's exception, if any, surfaces on the caller's thread
        except BaseException:
            self._thread.join()
            raise

    # ---- the caller's side (any thread / event loop) ------------------------------------------------------
    async def open(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                   outputs: asyncio.Queue | None = None) -> RequestStream:
        """Submit a request; returns once the engine accepted it. `UserError` (bad prompt) is raised here.

        Requests may share one `outputs` queue (a fan-out of n samples reads them merged, by request_id);
        the queue then also receives an `EngineError` per request if the engine fails."""
        loop = asyncio.get_running_loop()
        outputs = asyncio.Queue() if outputs is None else outputs
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # against the thread exiting between the check and the put
            if self.dead is not None:
                raise EngineError(f"the engine is not running: {self.dead}")
            self._commands.put(("add", request_id, list(prompt_ids), params, (loop, outputs), accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add: applied after it
            raise
        return RequestStream(self, request_id, outputs)

    async def open_many(self, requests: list[tuple[str, list[int], SamplingParams]], outputs: asyncio.Queue
                        ) -> None:
        """Submit several requests at once (the n choices of one API request): the engine thread takes them
        in one batch of commands, so they are admitted to the same step instead of one step apart. All or
        none: if one is refused (its error is raised), the others are aborted."""
        loop = asyncio.get_running_loop()
        accepted = [concurrent.futures.Future() for _ in requests]
        with self._lock:
            if self.dead is not None:
                raise EngineError(f"the engine is not running: {self.dead}")
            for (rid, ids, params), done in zip(requests, accepted):
                self._commands.put(("add", rid, list(ids), params, (loop, outputs), done))
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in accepted), return_exceptions=True)
        except asyncio.CancelledError:
            for rid, _, _ in requests:
                self.abort(rid)  # queued after the adds: applied after them
            raise
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for rid, _, _ in requests:
                self.abort(rid)
            raise failed[0]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[StepOutput]:
        """Outputs of one request as they are produced; leaving the loop early (or being cancelled) aborts it."""
        stream = await self.open(request_id, prompt_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread after its current step; open requests fail with `EngineError`."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------------------------
    def _run(self, factory, ready: concurrent.futures.Future) -> None:
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as e:
                self.dead = EngineError(f"the engine did not start: {e}")
                ready.set_exception(e)
                return
        self.engine.emit = self._publish  # a step's tokens go out once committed, not after the drafter ran
        ready.set_result(None)
        stop = False
        try:
            while not stop:
                busy = self.dead is None and self.engine.has_unfinished()
                commands, stop = self._take_commands(block=not busy)
                for cmd in commands:  # one at a time: a failing abort must not strand the adds behind it
                    if cmd[0] == "add":
                        self._guarded(self._add, *cmd[1:])
                    else:
                        self._guarded(self._abort, cmd[1])
                if not stop and self.dead is None and self.engine.has_unfinished():
                    self._guarded(self._step)
        except BaseException:
            log.exception("engine thread crashed")
            raise
        finally:
            with self._lock:
                self.dead = self.dead or EngineError("the engine was shut down")
                left, _ = self._take_commands(block=False)
            for cmd in left:
                if cmd[0] == "add":
                    cmd[-1].set_exception(EngineError(f"the engine is not running: {self.dead}"))
            self._fail_all(EngineError(f"the engine is not running: {self.dead}"))

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            log.exception("engine-wide failure; failing %d open request(s)", len(self._streams))
            self._recover(e)

    def _take_commands(self, block: bool) -> tuple[list, bool]:
        """Every queued command (waiting for one if `block`), and whether a stop was among them."""
        commands = []
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if cmd is _STOP:
                    return commands, True
                commands.append(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return commands, False

    def _add(self, request_id, prompt_ids, params, stream, accepted: concurrent.futures.Future) -> None:
        if self.dead is not None:
            accepted.set_exception(EngineError(f"the engine is not running: {self.dead}"))
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except Exception as e:  # UserError goes back to the caller as is, and so does a bug (logged there)
            accepted.set_exception(e)
            return
        self._streams[request_id] = stream
        accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self.dead is None:
            self.engine.abort(request_id)

    def _step(self) -> None:
        self._publish(self.engine.step())

    def _publish(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its consumer meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            _deliver(loop, items)

    def _recover(self, error: Exception) -> None:
        """Fail the open requests, then drop them from the engine so their blocks come back."""
        ids = list(self._streams)
        self._fail_all(EngineError("the engine failed (an engine-wide error, not this request's); every open "
                                   "request was stopped"))
        try:
            for rid in ids:
                self.engine.abort(rid)
        except Exception as e:
            log.exception("could not drop the failed requests; the engine is stopped")
            self.dead = EngineError(f"stopped after an internal error: {e!r}")

    def _fail_all(self, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, outputs in self._streams.values():
            by_loop.setdefault(loop, []).append((outputs, error))
        self._streams.clear()
        for loop, items in by_loop.items():
            _deliver(loop, items)


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    """One wake-up of the consumer's loop per step, however many requests it serves."""
    def put_all() -> None:
        for q, item in items:
            q.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
