"""The HTTP layer's guards, as plain ASGI (a BaseHTTPMiddleware would buffer streaming responses) and one
uvicorn protocol: request ids, ambiguous framing, the body cap and deadline, the API key, and the deadline
for request headers.

Each answers in OpenAI's error shape, so clients raise their usual exceptions. A request whose framing is
in doubt (a body over the cap, a body that did not arrive in time, ambiguous or malformed framing) is
answered with `Connection: close`: the bytes after it are never read as another request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import uuid

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from tsengine.entrypoints.openai import protocol as proto

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(proto.error_body(message, type_, param, code), status_code=status, headers=headers)


class RequestId:
    """Every request gets an id: the client's `X-Request-ID` when it is a sane token, else a fresh one. It is
    in `request.state.request_id` (logs, 5xx bodies) and sent back in the `X-Request-ID` response header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ShutdownCancel:
    """uvicorn's last resort on shutdown cancels the requests still running `timeout_graceful_shutdown` after
    the drain, and answers one that has not started its response with a plain-text 500. The drain
    (shutdown.py) ends every request it knows of before that; one it cannot know of (its body still
    arriving, say) gets OpenAI's 503 `server_shutting_down` here instead. Only a shutdown cancels a
    request's task; a response already started is left to uvicorn, which closes the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            e = proto.shutting_down()
            await error_response(e.status, e.message, e.param, e.type, e.code,
                                 {**e.headers, "Connection": "close"})(scope, receive, send)


class Framing:
    """RFC 9112 §6.1: a request with both Transfer-Encoding and Content-Length (or Transfer-Encoding in
    HTTP/1.0) has ambiguous framing. h11 frames it by Transfer-Encoding alone, a proxy in front may have
    used Content-Length, so whatever follows its body is not a request to trust (request smuggling). It is
    a 400 and the connection is closed without reading further."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and (b"content-length" in names or scope["http_version"] == "1.0"):
                why = "both Transfer-Encoding and Content-Length" if b"content-length" in names else \
                    "Transfer-Encoding in an HTTP/1.0 request"
                return await error_response(400, f"ambiguous request framing: {why} (RFC 9112 section 6.1); "
                                            "the connection is closed", None, "invalid_request_error",
                                            "invalid_framing", headers={"Connection": "close"})(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body over `limit` bytes, by its Content-Length or, without one, as it arrives; 408 for a
    body that has not fully arrived `timeout_s` after the request's headers (a stalled or trickling upload
    would otherwise hold its connection and its partial body forever). Both close the connection and drop
    what was read. The body is read here in full (it is needed in full anyway) and replayed to the app."""

    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        loop = asyncio.get_running_loop()
        chunks, size, deadline = [], 0, loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                chunks.clear()
                return await self._timed_out(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        await error_response(413, f"request body over the limit of {self.limit} bytes (--max-request-body-bytes)",
                             None, "invalid_request_error", "request_too_large",
                             headers={"Connection": "close"})(scope, receive, send)

    async def _timed_out(self, scope, receive, send):
        await error_response(408, f"request body not received within {self.timeout_s:g} s of the request's "
                             "headers (--body-timeout); the connection is closed", None, "invalid_request_error",
                             "request_timeout", headers={"Connection": "close"})(scope, receive, send)


class ApiKey:
    """Bearer-token check for /v1/*. The scheme is case-insensitive (RFC 7235); the key is compared in
    constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(given) > 1:  # which one counts is a guess a proxy may make differently: refuse them all
                return await error_response(401, f"{len(given)} Authorization headers: send exactly one "
                                            "'Authorization: Bearer <key>'", None, "authentication_error",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            auth = given[0] if given else b""
            scheme, _, token = auth.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                reason = "missing API key" if not auth else "incorrect API key"
                return await error_response(401, f"{reason}: send 'Authorization: Bearer <key>'", None,
                                            "authentication_error",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        await self.app(scope, receive, send)


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers have not arrived `timeout_s` after
    it opened (or after its last response): a client trickling bytes would otherwise hold it forever
    (uvicorn's keep-alive timer restarts on every byte). A request h11 cannot frame or parse gets its 400 in
    OpenAI's error shape (uvicorn's is plain text); the connection closes after it, as in uvicorn."""

    class HeaderDeadline(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            if self.cycle is not None and self.cycle.response_started:  # mid-response: only closing is left
                self.transport.close()
                return
            body = json.dumps(proto.error_body("malformed HTTP request (its framing or headers are invalid); the "
                                               "connection is closed", code="invalid_framing")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # h11 cannot send a response now: closing says enough
                pass
            self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._armed_cycle = self.cycle
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _expire(self):
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self.cycle is self._armed_cycle and not self.transport.is_closing():  # nothing since
                self.transport.close()

        def handle_events(self):
            super().handle_events()
            if self._deadline is not None and self.cycle is not self._armed_cycle:
                self._deadline.cancel()
                self._deadline = None

        def on_response_complete(self):
            super().on_response_complete()
            if self._deadline is None and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc):
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return HeaderDeadline
