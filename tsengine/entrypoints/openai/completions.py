"""Serving one /v1/completions or /v1/chat/completions request, from its body to its response.

Everything a user can get wrong is an `APIError` raised before the engine starts decoding, so a stream never
opens for a request that fails; the prompt rules are the engine's own (`Engine.check_prompt`), only the
limits that involve the request's other fields are checked here. Control-token strings in chat messages are
plain text unless the server says otherwise (chat_template.py). Tokenizing and chat templating run on a
thread pool (`TokenizerPool`): a 5 MB prompt must not stall the event loop that answers everyone else. A
request waiting for it is open for the shutdown drain as much as one in the engine. A request with `n`
choices is n engine requests (tsengine.entrypoints.fanout) submitted together and sharing one output queue. Every way a
request ends early (stop string, client gone, error, shutdown) aborts its engine requests, so blocks come
back.

Status codes: 400 for the request's own fault, including a request the engine stopped because its data
made a step fail (tsengine/engine/faults.py) and an `n` over the server's whole capacity (no wait would admit
it); 429 when the queue is full; 503 for an engine-wide failure or a server shutting down, with a generic
message and the request id (the log has the rest).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import re
import threading
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tsengine.entrypoints.fanout import fan_out
from tsengine.entrypoints.openai import protocol as proto
from tsengine.entrypoints.openai.async_engine import AsyncEngine, EngineError
from tsengine.entrypoints.openai.chat_template import ChatTemplate, ControlTokenError
from tsengine.entrypoints.openai.detokenize import ChoiceText
from tsengine.entrypoints.openai.prometheus import PrometheusMetrics
from tsengine.entrypoints.openai.protocol import APIError
from tsengine.entrypoints.openai.settings import ServerSettings
from tsengine.errors import UserError
from tsengine.sampling_params import SamplingParams

log = logging.getLogger("tsengine.entrypoints.openai.app")

SHUTDOWN = object()  # put on a request's output queue: the server is draining; end the choices with "abort"


class Completions:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine, self.settings, self.model_name = engine, settings, settings.model_name
        self.tokenizer = engine.engine.tokenizer
        self.chat = ChatTemplate(self.tokenizer, settings.sanitize_control_tokens)
        self.max_model_len = engine.engine.max_model_len
        self.capacity = engine.engine.config.max_num_seqs + settings.max_queue_len
        self.speculating = engine.engine.spec_steps > 0
        self.metrics = PrometheusMetrics(engine.engine)
        self.pool = TokenizerPool(settings.tokenizer_threads, "tsengine-tokenize")
        self.admitted = 0  # choices of the requests being served (tokenizing, queued or decoding)
        self.open: dict[str, asyncio.Queue] = {}  # request id -> its output queue, for the shutdown drain
        self.tokenizing: set[asyncio.Future] = set()  # requests waiting for the pool, for the drain too
        self.draining = False  # admits nothing more (the first signal)
        self.stopped = False  # ended every open request (the drain's deadline): nothing more enters the engine

    # ---- input -------------------------------------------------------------------------------------
    def prompt_ids(self, req) -> tuple[list[int], str]:
        """Runs on the tokenizer pool."""
        if isinstance(req, proto.ChatCompletionRequest):
            try:
                text = self.chat.render([m.as_template_input() for m in req.messages])
            except Exception as e:  # jinja raises for conversations the template refuses
                raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
            try:
                return self.chat.encode(text), "messages"
            except ControlTokenError as e:
                raise APIError(400, f"messages: {e}", "messages") from None
        if isinstance(req.prompt, str):  # as LLM.generate encodes a string prompt
            return self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"], "prompt"
        return list(req.prompt), "prompt"

    async def tokenize(self, req) -> tuple[list[int], str]:
        """`prompt_ids` on the pool. Meanwhile the request is open for the drain; `stop_all` ends the wait
        with a 503 (a queued tokenization is dropped, a running one finishes on its thread unread)."""
        work = asyncio.wrap_future(self.pool.submit(self.prompt_ids, req))
        self.tokenizing.add(work)
        try:
            await asyncio.wait((work,))  # unlike `await work`, tells stop_all's cancel from this task's
        finally:
            self.tokenizing.discard(work)
            work.cancel()  # a no-op once done; else this task was cancelled
        if work.cancelled() or self.stopped:
            raise proto.shutting_down()
        return work.result()

    def check(self, req, ids: list[int], field: str) -> SamplingParams:
        try:  # reads only fields fixed at construction: safe off the engine thread
            self.engine.engine.check_prompt(ids)
        except UserError as e:
            raise _bad_request(e, field) from None
        asked = req.requested_max_tokens
        if asked is not None and len(ids) + asked > self.max_model_len:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{name}: {asked} plus the {len(ids)} prompt tokens exceeds the context of "
                           f"{self.max_model_len} tokens (max_model_len)", name)
        try:
            return req.sampling_params(len(ids), self.max_model_len, self.settings.default_max_tokens)
        except UserError as e:
            raise _bad_request(e, field) from None

    def admit(self, req) -> None:
        if self.draining:
            raise proto.shutting_down()
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        if req.n > self.capacity:  # no wait would help: not a 429
            raise APIError(400, f"n: {req.n} choices can never be admitted; this server runs at most "
                           f"{self.capacity} choices at once (max_num_seqs + --max-queue-len)", "n")
        if self.admitted + req.n > self.capacity:
            raise APIError(429, f"the server is at capacity ({self.admitted} choices in flight, at most "
                           f"{self.capacity}: max_num_seqs + --max-queue-len); retry later", None,
                           "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": "1"})

    # ---- generation -----------------------------------------------------------------------------------
    async def events(self, rid: str, ids: list[int], params: SamplingParams, choices: list[ChoiceText], field: str,
                     arrival: float):
        """Yields None once the engine accepted every choice, then (index, text delta, finish_reason)."""
        outputs: asyncio.Queue = asyncio.Queue()
        subs = fan_out(rid, params)
        live = {sub_id: i for i, (sub_id, _) in enumerate(subs)}
        m = self.metrics
        self.open[rid] = outputs
        if self.stopped:  # came in after stop_all: ends at once, like the others
            outputs.put_nowait(SHUTDOWN)
        try:
            try:
                await self.engine.open_many([(sub_id, ids, p) for sub_id, p in subs], outputs)
            except UserError as e:
                live.clear()  # open_many aborted them
                raise _bad_request(e, field) from None
            m.prompt_tokens.inc(len(ids))
            yield None
            while live:
                out = await outputs.get()
                if out is SHUTDOWN:
                    for sub_id, i in list(live.items()):
                        choices[i].finish_reason = "abort"
                        yield i, choices[i].pending(), "abort"
                    return
                if isinstance(out, BaseException):
                    raise out
                i = live.get(out.request_id)
                if i is None:  # a choice already cut by a stop string
                    continue
                if out.finish_reason == "error":
                    del live[out.request_id]
                    raise APIError(400, f"{out.error} (request id {rid})", None, code="request_failed")
                c, now = choices[i], time.monotonic()
                if out.new_tokens:
                    m.generation_tokens.inc(len(out.new_tokens))
                    (m.itl.observe(now - c.last_token_time) if c.last_token_time is not None
                     else m.ttft.observe(now - arrival))
                    c.last_token_time = now
                c.update(out)
                if c.finish_reason:
                    del live[out.request_id]
                    if not out.finished:
                        self.engine.abort(out.request_id)
                    m.success.labels(c.finish_reason).inc()
                delta = c.pending()
                if delta or c.finish_reason:
                    yield i, delta, c.finish_reason
        finally:
            self.open.pop(rid, None)
            for r in live:
                self.engine.abort(r)

    def usage(self, n_prompt: int, choices: list[ChoiceText]) -> dict:
        spec = (sum(c.verify_steps for c in choices), sum(c.accepted for c in choices)) if self.speculating else None
        return proto.usage(n_prompt, sum(c.tokens for c in choices), spec)

    async def handle(self, req, request: Request):
        chat, arrival = isinstance(req, proto.ChatCompletionRequest), time.monotonic()
        request_id = request.state.request_id
        self.admit(req)
        self.admitted += req.n
        release = True
        try:
            ids, field = await self.tokenize(req)
            params = self.check(req, ids, field)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            log.info("request %s: %s, %d prompt tokens, n=%d, max_tokens=%d", request_id, rid, len(ids),
                     params.n, params.max_tokens)
            choices = [ChoiceText(self.tokenizer, req.stop_strings) for _ in range(params.n)]
            events = self._released(self.events(rid, ids, params, choices, field, arrival), req.n)
            release = False  # from here the generator releases the slots, whenever it ends
            await events.__anext__()  # UserError etc. surface here, before any byte of the response is sent
            if req.stream:
                with_usage = bool(req.stream_options and req.stream_options.include_usage)
                return StreamingResponse(self.sse(rid, chat, events, len(ids), choices, with_usage, request_id),
                                         media_type="text/event-stream")
            if not await _unless_disconnected(request, _drain(events)):
                return Response(status_code=499)  # nobody is listening; the engine requests are aborted
            return JSONResponse(proto.completion(rid, self.model_name, chat, [c.text for c in choices],
                                                 [c.finish_reason for c in choices], self.usage(len(ids), choices)))
        finally:
            if release:
                self.admitted -= req.n

    async def _released(self, events, n: int):
        """`events`, giving back the request's admission slots when it ends (however it ends)."""
        try:
            async for item in events:
                yield item
        finally:
            self.admitted -= n
            await events.aclose()

    async def sse(self, rid: str, chat: bool, events, n_prompt: int, choices: list[ChoiceText], with_usage: bool,
                  request_id: str):
        created, name = int(time.time()), self.model_name
        data = lambda body: f"data: {json.dumps(body, ensure_ascii=False)}\n\n"  # noqa: E731
        try:
            if chat:  # OpenAI opens every chat choice with the assistant role
                yield data(proto.chunk(rid, name, chat, created, [proto.chunk_choice(chat, i, "", None, role=True)
                                                                   for i in range(len(choices))], with_usage))
            async for i, delta, reason in events:
                yield data(proto.chunk(rid, name, chat, created, [proto.chunk_choice(chat, i, delta, reason)],
                                       with_usage))
            if with_usage:
                yield data(proto.chunk(rid, name, chat, created, [], True, self.usage(n_prompt, choices)))
        except APIError as e:  # headers are sent: report in-band, as OpenAI does
            yield data(proto.error_body(e.message, e.type, e.param, e.code))
        except EngineError:
            yield data(proto.error_body(engine_failure(request_id), "internal_error"))
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    @property
    def busy(self) -> bool:
        """A request is open: in the engine, or admitted and waiting for its prompt's tokens."""
        return bool(self.open or self.tokenizing)

    def stop_all(self) -> int:
        """Shutdown: end every open request now, returns how many. Its choices finish with "abort"; one still
        waiting for the tokenizer gets a 503 `server_shutting_down`."""
        self.draining = self.stopped = True
        for outputs in self.open.values():
            outputs.put_nowait(SHUTDOWN)
        for work in self.tokenizing:
            work.cancel()
        return len(self.open) + len(self.tokenizing)

    def close(self) -> None:
        """The tokenizer pool: its queue is dropped, and nothing waits for a tokenization still running."""
        self.pool.shutdown()


class TokenizerPool:
    """A few daemon threads running blocking calls (tokenizing, chat templating); submit returns a Future.

    Not a ThreadPoolExecutor: at exit Python joins those threads after they ran everything still queued, so
    a SIGTERM with 5 MB prompts queued kept the process alive for minutes. Here `shutdown` cancels what is
    queued and waits for nothing: a call still running finishes on its daemon thread, or the process exits
    under it. A call submitted after shutdown comes back cancelled."""

    def __init__(self, threads: int, name: str):
        self.size, self.name = threads, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.cancel()
                return fut
            self._queue.put((fut, fn, args))
            if len(self._threads) < self.size:  # started as needed, as a ThreadPoolExecutor does
                t = threading.Thread(target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        return fut

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)
            del item  # an idle thread keeps no 5 MB request alive

    @staticmethod
    def _run(fut: concurrent.futures.Future, fn, args) -> None:
        if fut.set_running_or_notify_cancel():  # else cancelled while queued
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                fut, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            fut.cancel()
        for _ in self._threads:
            self._queue.put(None)


def engine_failure(request_id: str) -> str:
    return f"the engine failed while serving this request; retry it (request id {request_id})"


async def _drain(events) -> bool:
    async for _ in events:
        pass
    return True


async def _unless_disconnected(request: Request, work):
    """Run `work`, cancelling it (its finally aborts the engine requests) if the client goes away first;
    None then. Starlette notices a disconnect only while streaming, so a plain response needs this."""
    task = asyncio.ensure_future(work)

    async def gone():
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server that cannot tell us: never claim a disconnect
            await asyncio.Future()

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


_FIELDS = set(proto.ChatCompletionRequest.model_fields) | set(proto.CompletionRequest.model_fields)


def _bad_request(e: UserError, prompt_field: str) -> APIError:
    """A UserError as a 400 naming the request field it is about. The engine says "prompt:" for what the
    client may have sent as `messages`; other errors name their field inside ("... - temperature is -1")."""
    message = str(e)
    if message.startswith("prompt:"):
        return APIError(400, prompt_field + message[len("prompt"):], prompt_field)
    m = re.search(r"(?:^|- )(\w+)(?: is|:)", message)
    return APIError(400, message, m.group(1) if m and m.group(1) in _FIELDS else None)
