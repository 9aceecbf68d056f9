"""The HTTP layer's guards, as plain ASGI (a BaseHTTPMiddleware would buffer streaming responses) and one
uvicorn protocol: request ids, the body cap, the API key, and the deadline for request headers.

Each answers in OpenAI's error shape, so clients raise their usual exceptions.
"""

from __future__ import annotations

import hmac
import re
import uuid

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


class BodyLimit:
    """413 for a body over `limit` bytes, by its Content-Length or, without one, as it arrives. The body is
    read here in full (it is needed in full anyway) and replayed to the app."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
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


class ApiKey:
    """Bearer-token check for /v1/*. The scheme is case-insensitive (RFC 7235); the key is compared in
    constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
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
    (uvicorn's keep-alive timer restarts on every byte)."""

    class HeaderDeadline(H11Protocol):
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
