"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Everything a user can get wrong is a 400 in OpenAI's error shape naming the field (pydantic's 422 is
turned into it), checked before a request reaches the engine thread; only bugs become 500s with a trace in
the log. A request with `n` choices is n engine requests sharing one output queue. Text is detokenized
incrementally; with stop strings the last (longest stop − 1) characters are held back from the stream
until they can no longer start a stop string, so a stream never shows text the final answer cuts. Every
way a request ends early (stop string, client gone, error) aborts its engine requests, so blocks come back.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from tsengine import openai_protocol as proto
from tsengine.async_engine import AsyncEngine, EngineError
from tsengine.config import EngineConfig
from tsengine.errors import UserError

log = logging.getLogger("tsengine")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


# ---- text: incremental detokenization and stop strings ---------------------------------------------------
class Detokenizer:
    """Decodes a growing token list piece by piece. A piece is decoded together with the tokens before it
    (so merges and leading spaces come out as in a full decode), and text ending in an incomplete UTF-8
    character ("\\ufffd") is held until the next token completes it, or until the end."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, new: list[int], final: bool = False) -> str:
        self.ids.extend(new)
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = dec(self.ids[self.prefix:self.read])
        now = dec(self.ids[self.prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""


class ChoiceText:
    """One choice: its text so far, where a stop string cut it, and how much of it was already sent."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok, self.stops = Detokenizer(tokenizer), stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent = "", 0
        self.finish_reason: str | None = None
        self.tokens = self.verify_steps = self.accepted = 0
        self.last_token_time: float | None = None

    def update(self, out) -> None:
        self.tokens += len(out.new_tokens)
        self.verify_steps += int(out.verify)
        self.accepted += out.accepted
        start = max(0, len(self.text) - self.hold)
        self.text += self.detok.push(out.new_tokens, final=out.finished)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.finish_reason = self.text[:min(hits)], "stop"
        elif out.finished:
            self.finish_reason = out.finish_reason

    def pending(self) -> str:
        """The text not yet sent that no stop string can still cut."""
        end = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta


# ---- metrics ---------------------------------------------------------------------------------------------
class _EngineCollector:
    """Engine counters read at scrape time (ints written by the engine thread; a read is atomic)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e, st = self.engine, self.engine.stats
        for name, value, doc in (("num_drafts", st.num_drafts, "verify steps (draft chains checked)"),
                                 ("num_draft_tokens", st.num_draft_tokens, "draft tokens proposed"),
                                 ("num_accepted_tokens", st.num_accepted, "draft tokens accepted")):
            yield CounterMetricFamily(f"tsengine:spec_decode_{name}", f"Speculative decoding: {doc}.", value=value)
        per = CounterMetricFamily("tsengine:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by draft position.", labels=["position"])
        for i, v in enumerate(list(st.accepted_per_pos)):
            per.add_metric([str(i)], v)
        yield per
        sched, blocks = e.scheduler, e.runner.blocks
        yield GaugeMetricFamily("tsengine:num_requests_running", "Requests scheduled.", value=len(sched.running))
        yield GaugeMetricFamily("tsengine:num_requests_waiting", "Requests queued.", value=len(sched.waiting))
        yield GaugeMetricFamily("tsengine:kv_cache_usage_perc", "Fraction of KV blocks in use.",
                                value=1 - blocks.num_free / max(1, blocks.num_blocks))


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
        self.success = Counter("tsengine:request_success", "Finished choices.", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tsengine:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("tsengine:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("tsengine:time_to_first_token_seconds", "Arrival to first token.", registry=r,
                              buckets=(.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10,
                                       20, 40, 80, 160, 640))
        self.itl = Histogram("tsengine:inter_token_latency_seconds",
                             "Time between two outputs of a request (one output may carry several accepted "
                             "tokens).", registry=r,
                             buckets=(.01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 7.5, 10, 20))


# ---- the app ---------------------------------------------------------------------------------------------
class _Server:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.speculating = engine.engine.spec_steps > 0
        self.metrics = Metrics(engine.engine)

    # ---- input -------------------------------------------------------------------------------------
    def prompt_ids(self, req) -> tuple[list[int], str]:
        if isinstance(req, proto.ChatCompletionRequest):
            try:
                text = self.tokenizer.apply_chat_template([m.as_template_input() for m in req.messages],
                                                          add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja raises for conversations the template refuses
                raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], "messages"
        if isinstance(req.prompt, str):  # as LLM.generate encodes a string prompt
            return self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"], "prompt"
        return list(req.prompt), "prompt"

    def check(self, req, ids: list[int], field: str):
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        if not ids:
            raise APIError(400, f"{field}: empty; the model needs at least one token", field)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{field}: {len(ids)} tokens; the context is {self.max_model_len} tokens "
                           "(max_model_len) including at least one generated token", field)
        asked = req.requested_max_tokens
        if asked is not None and len(ids) + asked > self.max_model_len:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{name}: {asked} plus the {len(ids)} prompt tokens exceeds the context of "
                           f"{self.max_model_len} tokens (max_model_len)", name)
        try:
            return req.sampling_params(len(ids), self.max_model_len)
        except UserError as e:
            raise APIError(400, str(e), _named_field(str(e))) from None

    # ---- generation -----------------------------------------------------------------------------------
    async def events(self, rid: str, ids: list[int], params: list, choices: list[ChoiceText], field: str,
                     arrival: float):
        """Yields None once the engine accepted every choice, then (index, text delta, finish_reason)."""
        outputs: asyncio.Queue = asyncio.Queue()
        live: dict[str, int] = {}
        m = self.metrics
        try:
            for i, p in enumerate(params):
                try:
                    await self.engine.open(f"{rid}-{i}", ids, p, outputs)
                except UserError as e:
                    raise APIError(400, str(e).replace("prompt:", f"{field}:", 1), field) from None
                live[f"{rid}-{i}"] = i
            m.prompt_tokens.inc(len(ids))
            yield None
            while live:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                i = live.get(out.request_id)
                if i is None:  # a choice already cut by a stop string
                    continue
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
            for r in live:
                self.engine.abort(r)

    def usage(self, n_prompt: int, choices: list[ChoiceText]) -> dict:
        spec = (sum(c.verify_steps for c in choices), sum(c.accepted for c in choices)) if self.speculating else None
        return proto.usage(n_prompt, sum(c.tokens for c in choices), spec)

    async def handle(self, req, request: Request):
        chat, arrival = isinstance(req, proto.ChatCompletionRequest), time.monotonic()
        ids, field = self.prompt_ids(req)
        params = self.check(req, ids, field)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = [ChoiceText(self.tokenizer, req.stop_strings) for _ in params]
        events = self.events(rid, ids, params, choices, field, arrival)
        await events.__anext__()  # UserError etc. surface here, before any byte of the response is sent
        if req.stream:
            with_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.sse(rid, chat, events, len(ids), choices, with_usage),
                                     media_type="text/event-stream")
        if not await _unless_disconnected(request, _drain(events)):
            return Response(status_code=499)  # nobody is listening; the engine requests are aborted
        return JSONResponse(proto.completion(rid, self.model_name, chat, [c.text for c in choices],
                                             [c.finish_reason for c in choices], self.usage(len(ids), choices)))

    async def sse(self, rid: str, chat: bool, events, n_prompt: int, choices: list[ChoiceText], with_usage: bool):
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
        except (APIError, EngineError) as e:  # headers are sent: report in-band, as OpenAI does
            yield data(proto.error_body(getattr(e, "message", str(e)), "internal_error"))
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"


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


def _named_field(message: str) -> str | None:
    """The request field a UserError talks about ("... - temperature is -1; ..." -> "temperature")."""
    m = re.search(r"(?:^|- )(\w+)(?: is|:)", message)
    return m.group(1) if m and m.group(1) in _FIELDS else None


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
           code: str | None = None) -> JSONResponse:
    return JSONResponse(proto.error_body(message, type_, param, code), status_code=status)


class _ApiKey:
    """Bearer-token check for /v1/* as plain ASGI (a BaseHTTPMiddleware would wrap streaming responses)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + self.key):
                reason = "missing API key" if not auth else "incorrect API key"
                return await _error(401, f"{reason}: send 'Authorization: Bearer <key>'", None,
                                    "authentication_error")(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="tsengine", summary="OpenAI-compatible EAGLE-3 speculative decoding server")
    server = app.state.server = _Server(async_engine, model_name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [x for x in err["loc"] if x != "body"]
        if err["type"] == "json_invalid":
            return _error(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        if not loc:  # the body as a whole: empty, not an object, or not sent as JSON
            return _error(400, "request body must be a JSON object sent with Content-Type: application/json")
        field = str(loc[0]) if isinstance(loc[0], str) else None
        where = ".".join(str(x) for x in loc)
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        got = f" (got {err['input']!r})" if err["type"] != "missing" else ""
        return _error(400, f"{where}: {msg}{got}", field)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error(e.status, e.message, e.param, e.type, e.code)

    @app.exception_handler(EngineError)
    async def _engine_error(_, e: EngineError):
        return _error(503, str(e), None, "internal_error")

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):
        return _error(e.status_code, str(e.detail), None, "not_found_error" if e.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(Exception)
    async def _bug(_, e: Exception):  # Starlette still logs the trace; the client gets the usual shape
        return _error(500, f"internal error: {type(e).__name__}; see the server log", None, "internal_error")

    @app.post("/v1/completions")
    async def completions(req: proto.CompletionRequest, request: Request):
        return await server.handle(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: proto.ChatCompletionRequest, request: Request):
        return await server.handle(req, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tsengine", "max_model_len": server.max_model_len}]}

    @app.get("/health")
    async def health():
        if async_engine.dead is not None:
            return _error(503, f"engine not running: {async_engine.dead}", None, "internal_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if api_key:
        app.add_middleware(_ApiKey, key=api_key)
    return app


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None) -> None:
    """Build the engine, serve until interrupted. Binds loopback unless told otherwise: no key by default."""
    import uvicorn

    from tsengine.engine import Engine

    engine = AsyncEngine(lambda: Engine(config))  # built on the engine thread: see async_engine
    try:
        uvicorn.run(build_app(engine, served_model_name or config.model, api_key), host=host, port=port,
                    log_level="info")
    finally:
        engine.shutdown()
