"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every answer that is not a success has OpenAI's error shape, so OpenAI clients raise their usual
exceptions: a user's mistake is a 400 naming the field (pydantic's 422 is turned into it), a missing or
wrong key a 401, an engine failure a 503, and only bugs a 500, with the trace in the server log rather
than in the response. What a completion request does is tsengine.completions.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from tsengine import openai_protocol as proto
from tsengine.async_engine import AsyncEngine, EngineError
from tsengine.completions import Completions
from tsengine.config import EngineConfig
from tsengine.openai_protocol import APIError

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
    server = app.state.server = Completions(async_engine, model_name)

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
