"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every answer that is not a success has OpenAI's error shape, so OpenAI clients raise their usual
exceptions: a user's mistake is a 400 naming the field (pydantic's 422 is turned into it), a missing or
wrong key a 401, a body that did not arrive in time 408, a body over the cap 413, a full queue 429, an
engine-wide failure or a draining server 503 (a generic message and the request id: the log has the rest),
and only bugs a 500. /openapi.json documents exactly these. What a completion request does is
`completions.py`; the guards in front of it are `guards.py`; shutdown is `shutdown.py`.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from tsengine.config import EngineConfig
from tsengine.entrypoints.openai import protocol as proto
from tsengine.entrypoints.openai.async_engine import AsyncEngine, EngineError
from tsengine.entrypoints.openai.completions import Completions, engine_failure
from tsengine.entrypoints.openai.guards import ApiKey, BodyLimit, Framing, RequestId, ShutdownCancel, error_response
from tsengine.entrypoints.openai.protocol import APIError
from tsengine.entrypoints.openai.settings import ServerSettings

_ERRORS = {400: "the request is invalid: the message names the field",
           401: "missing or incorrect API key (only when the server has one)",
           404: "the request names a model this server does not serve",
           408: "the request body did not arrive within the server's deadline (--body-timeout)",
           413: "the request body is over the server's limit",
           429: "the server's queue is full; Retry-After says when to retry",
           503: "the engine failed (not because of this request) or the server is shutting down"}


def _documented(*codes: int) -> dict:
    return {c: {"model": proto.ErrorResponse, "description": _ERRORS[c]} for c in codes}


def build_app(async_engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="tsengine", summary="OpenAI-compatible EAGLE-3 speculative decoding server")
    server = app.state.server = Completions(async_engine, settings)
    key = (401,) if settings.api_key else ()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        errors = exc.errors()  # a union field reports one error per member: the most specific one tells
        err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        loc = [x for x in err["loc"] if x != "body" and not _union_tag(x)]
        if err["type"] == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
        if not loc:  # the body as a whole: empty, not an object, or not sent as JSON
            return error_response(400, "request body must be a JSON object sent with Content-Type: application/json")
        field = str(loc[0]) if isinstance(loc[0], str) else None
        where = ".".join(str(x) for x in loc)
        msg = {"extra_forbidden": "unknown field",  # pydantic's own words for a lone surrogate say less
               "string_unicode": "contains a lone UTF-16 surrogate, which is not valid Unicode",
               }.get(err["type"], err["msg"])
        got = f" (got {_short(err['input'])})" if err["type"] != "missing" else ""
        return error_response(400, f"{where}: {msg}{got}", field)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError):
        return error_response(503, engine_failure(request.state.request_id), None, "internal_error")

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):  # its headers matter: 405 carries Allow
        return error_response(e.status_code, str(e.detail), None, "not_found_error" if e.status_code == 404 else
                              "invalid_request_error", headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):  # Starlette still logs the trace
        return error_response(500, f"internal error; see the server log (request id {request.state.request_id})",
                              None, "internal_error")

    @app.post("/v1/completions", responses=_documented(400, *key, 404, 408, 413, 429, 503))
    async def completions(req: proto.CompletionRequest, request: Request):
        return await server.handle(req, request)

    @app.post("/v1/chat/completions", responses=_documented(400, *key, 404, 408, 413, 429, 503))
    async def chat_completions(req: proto.ChatCompletionRequest, request: Request):
        return await server.handle(req, request)

    @app.get("/v1/models", responses=_documented(*key))
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "tsengine", "max_model_len": server.max_model_len}]}

    @app.get("/health", responses=_documented(503))
    async def health() -> dict[str, str]:
        if async_engine.dead is not None:
            return error_response(503, "the engine is not running", None, "internal_error")
        if server.draining:
            return error_response(503, "the server is shutting down", None, "service_unavailable",
                                  "server_shutting_down")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)
    if settings.api_key:
        app.add_middleware(ApiKey, key=settings.api_key)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(Framing)  # before anything reads the body
    app.add_middleware(ShutdownCancel)  # no plain-text 500 from uvicorn's shutdown
    app.add_middleware(RequestId)  # outermost: every answer, 401 and 413 included, carries the id
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema less the 422 it documents for every body: this server answers 400 instead."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema["paths"].values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _union_tag(part) -> bool:
    """pydantic names the member of a union in the error location ("str", "list[int]", "function-after[...]")."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def server_engine(config: EngineConfig, settings: ServerSettings):
    """The engine as a server runs it: warmed up, then its compiles wait for a moment it is idle."""
    from tsengine.engine import Engine

    engine = Engine(config)
    if settings.warmup:
        engine.warm_up()
    engine.compile_when_idle()
    return engine


def serve(config: EngineConfig, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Build the engine, serve until a signal. Binds loopback unless told otherwise: no key by default."""
    from tsengine.entrypoints.openai.shutdown import run_until_drained

    engine = AsyncEngine(lambda: server_engine(config, settings))  # built on the engine thread: see async_engine
    try:
        run_until_drained(build_app(engine, settings), settings, host, port)
    finally:
        engine.shutdown(timeout=5.0)

