"""The HTTP edges found by probing a running server (issue 43), a regression test each: a body that never
finishes arriving, ambiguous or malformed framing (request smuggling), duplicate Authorization headers, an `n`
no wait could admit, and JSON null for OpenAI's nullable fields.

Several speak raw HTTP/1.1 on a socket: httpx would not send these requests, or would hide what the server
did with the connection. The server is the one `tsengine serve` runs (the header deadline protocol), with
short deadlines so that each guard is reached quickly.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.helpers.server import post, serving
from tsengine.config import EngineConfig, SpeculativeConfig

KEY, MODEL, CONTEXT = "sk-test", "tiny-llama", 128
PROMPT = "the water is hot and"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
BODY_TIMEOUT = 1.0
LIMITS = dict(default_max_tokens=6, max_queue_len=4, header_timeout_s=2.0, body_timeout_s=BODY_TIMEOUT)


@pytest.fixture(scope="module")
def server(tiny_dirs, heads):
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}
    config = EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=CONTEXT, block_size=4, max_num_seqs=4,
                               speculative=SpeculativeConfig.resolve(config_json=spec))
    with serving(config, MODEL, KEY, **LIMITS) as s:
        yield s


def exchange(server, data: bytes, wait: float = 6.0) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection and read until the server closes it or `wait` seconds pass: what
    came back, and whether the server closed the connection."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(0.1)
    got, deadline = b"", time.monotonic() + wait
    try:
        sock.sendall(data)
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                return got, True
            if not chunk:
                return got, True
            got += chunk
        return got, False
    finally:
        sock.close()


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in `raw` (status, headers, body), each framed by its Content-Length (without one: the
    rest, up to the close)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines))
        size = int(headers.get("content-length", len(rest)))
        out.append((int(status_line.split()[1]), headers, rest[:size]))
        raw = rest[size:]
    return out


def assert_error_shape(status: int, body: bytes, expected: int, param: str | None = None) -> dict:
    assert status == expected, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and b"Traceback" not in body
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    return err


def still_serving(server) -> None:
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


# ---- 3: a body deadline ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickled"])
def test_3_a_body_that_does_not_arrive_in_time_is_a_408_and_its_connection_closes(server, trickle):
    """Headers in time, then part of the body and nothing more (or one byte every 0.2 s): uvicorn would wait
    forever, the connection and its partial body held. It is cut at --body-timeout (1 s here)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(0.2)
    got, closed, t0 = b"", False, time.monotonic()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + AUTH
                     + b'Content-Length: 1000\r\n\r\n{"prompt": "')
        while not closed and time.monotonic() - t0 < BODY_TIMEOUT + 5:
            try:
                if trickle:
                    sock.sendall(b"x")
                chunk = sock.recv(65536)
                got, closed = got + chunk, not chunk
            except socket.timeout:
                pass
            except OSError:  # a write after the close: reset
                closed = True
        elapsed = time.monotonic() - t0
    finally:
        sock.close()
    assert closed, f"the connection was still open after {elapsed:.1f} s"
    assert elapsed >= BODY_TIMEOUT * 0.9
    if got or not trickle:  # a trickling client may be reset before it reads the answer (its last byte unread)
        [(status, headers, body)] = responses(got)
        assert assert_error_shape(status, body, 408)["code"] == "request_timeout"
        assert headers["connection"] == "close"
    still_serving(server)


# ---- 4: framing errors close the connection -------------------------------------------------------------------
SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("version, head, body", [
    (b"1.1", b"Content-Length: 40\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),  # RFC 9112 6.1: smuggling
    (b"1.1", b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", b"0\r\n\r\n"),
    (b"1.0", b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\n"),  # RFC 9112 6.1 too
    (b"1.1", b"Content-Length: 1x\r\n", b""),  # the ones h11 finds: uvicorn's answer was plain text
    (b"1.1", b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello"),
    (b"1.1", b"Transfer-Encoding: gzip\r\n", b""),
    (b"1.1", b"Transfer-Encoding: chunked\r\n", b"zz\r\nhello\r\n0\r\n\r\n"),  # a bad chunk, as the app reads
], ids=["cl-te", "te-cl", "te-http1.0", "bad-length", "two-lengths", "te-gzip", "bad-chunk"])
def test_4_a_framing_error_is_a_400_and_nothing_after_it_is_served(server, version, head, body):
    """A request with both Transfer-Encoding and Content-Length was a 400 on a connection left open, and the
    bytes after its `0\\r\\n\\r\\n` were served as a second request. Any framing error is one 400 in OpenAI's
    shape with `Connection: close`, and the connection closes without reading on."""
    raw = (b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n" + AUTH
           + head + b"\r\n")
    got, closed = exchange(server, raw + body + SMUGGLED)
    assert closed, got
    answers = responses(got)
    assert len(answers) == 1, answers  # the smuggled request was never served
    [(status, headers, answer)] = answers
    assert headers["connection"] == "close" and headers["content-type"] == "application/json", (headers, answer)
    assert assert_error_shape(status, answer, 400)["code"] == "invalid_framing"
    still_serving(server)


# ---- 5: one Authorization header ------------------------------------------------------------------------------
@pytest.mark.parametrize("keys", [("sk-wrong", KEY), (KEY, "sk-wrong"), (KEY, KEY)])
def test_5_more_than_one_authorization_header_is_a_401(server, keys):
    """The last header won: (wrong, right) got in and (right, wrong) did not, so a proxy that checks the
    first one and this server disagreed. Two headers are refused whatever they say."""
    headers = [("Content-Type", "application/json")] + [("Authorization", f"Bearer {k}") for k in keys]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers,
                   timeout=30)
    err = assert_error_shape(r.status_code, r.content, 401)
    assert err["type"] == "authentication_error" and "exactly one 'Authorization" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=KEY).status_code == 200


# ---- 6: n over the capacity -----------------------------------------------------------------------------------
def test_6_n_over_the_servers_capacity_is_a_400_naming_n(server):
    """More choices than max_num_seqs + --max-queue-len can never be admitted: a 429 with Retry-After told
    the client to retry forever."""
    capacity = server.engine.config.max_num_seqs + LIMITS["max_queue_len"]
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": capacity + 1})
    err = assert_error_shape(r.status_code, r.content, 400, "n")
    assert str(capacity) in err["message"] and "retry-after" not in r.headers
    full = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": capacity})
    assert full.status_code == 200 and len(full.json()["choices"]) == capacity


# ---- 7: null is the default -----------------------------------------------------------------------------------
def test_7_null_for_a_nullable_field_is_its_default(server):
    """The official client sends null for a parameter passed as None; OpenAI reads it as the default. Each
    was a 400. A wrong type or range still names its field."""
    nulls = dict(top_p=None, n=None, stream=None, stop=None, seed=None, user=None)
    greedy = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    plain = server.client.completions.create(prompt=PROMPT, **greedy).choices[0].text
    nulled = server.client.completions.create(prompt=PROMPT, **nulls, **{
        **greedy, "extra_body": {"ignore_eos": True, "top_k": None, "min_p": None, "stop_token_ids": None}})
    assert [c.text for c in nulled.choices] == [plain] and plain
    defaults = server.client.completions.create(model=MODEL, prompt=PROMPT, temperature=None, max_tokens=None,
                                                extra_body={"ignore_eos": True})
    assert defaults.usage.completion_tokens == LIMITS["default_max_tokens"] and len(defaults.choices) == 1

    messages = [{"role": "user", "content": PROMPT}]
    chat = server.client.chat.completions.create(messages=messages, **greedy).choices[0].message.content
    chat_nulled = server.client.chat.completions.create(
        messages=messages, **nulls, stream_options=None, max_completion_tokens=None, **greedy)
    assert [c.message.content for c in chat_nulled.choices] == [chat]

    for field, value in [("temperature", "hot"), ("top_p", 0), ("n", 0), ("stream", "yes"), ("top_k", 1.5)]:
        r = post(server, "/v1/completions", {"prompt": "x", field: value})
        assert_error_shape(r.status_code, r.content, 400, field)
