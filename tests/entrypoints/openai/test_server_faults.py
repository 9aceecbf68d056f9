"""One bad client cannot hurt the others (issue 14): a regression test per failure found by probing the
server, and a fault suite (poisoned request among streams, disconnect storm, KV exhaustion, slow clients).

The server here is the one `tsengine serve` runs: tiny Llama target, a random EAGLE-3 head, the header
deadline protocol, small limits so that each guard is reached quickly.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.server import post, serving, slow_steps, wait_idle
from tsengine.config import EngineConfig, SpeculativeConfig

KEY, MODEL, CONTEXT = "sk-test", "tiny-llama", 128
PROMPT = "the water is hot and"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = dict(default_max_tokens=8, max_queue_len=4, max_body_bytes=64 * 1024, header_timeout_s=1.0)


@pytest.fixture(scope="module")
def head_dir(heads):
    return heads["llama"]  # conftest's: decisive logits, no near-ties among drafts


def config(tiny_dirs, head_dir, **kw) -> EngineConfig:
    spec = {"method": "eagle3", "adaptive": False, "model": str(head_dir), "num_speculative_tokens": 3}
    return EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=CONTEXT, block_size=4, debug_checks=True,
                             max_num_seqs=4, speculative=SpeculativeConfig.resolve(config_json=spec), **kw)


@pytest.fixture(scope="module")
def server(tiny_dirs, head_dir):
    with serving(config(tiny_dirs, head_dir), MODEL, KEY, **LIMITS) as s:
        yield s


def complete(server, **body) -> str:
    return server.client.completions.create(model=MODEL, **body).choices[0].text


def stream_text(server, body: dict) -> tuple[str, list[dict]]:
    """A streamed completion's text and every event it sent (the last one before [DONE] included)."""
    text, events = "", []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if line != "data: [DONE]":
                    event = json.loads(line[6:])
                    text += "".join(c["text"] for c in event.get("choices", []))
    return text, events


def assert_error_shape(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    return err


LONG = dict(prompt=PROMPT, max_tokens=40, temperature=0, ignore_eos=True)


# ---- the eight failures, each a regression test ----------------------------------------------------------------
def test_1_top_k_beyond_int64_is_a_400_and_hurts_no_concurrent_stream(server):
    alone, _ = stream_text(server, LONG)
    with slow_steps(server.engine, 0.02), ThreadPoolExecutor(2) as pool:
        other = pool.submit(stream_text, server, LONG)
        time.sleep(0.1)
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0.5,
                                             "top_k": 9223372036854775808})
        text, events = other.result()
    assert_error_shape(r, 400, "top_k")
    assert text == alone and events[-1] == "[DONE]" and '"error"' not in "".join(events)
    wait_idle(server.engine)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", b'{"prompt": "hi \\ud800"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"]}', "stop"),
])
def test_2_lone_surrogate_is_a_400(server, path, body, field):
    r = post(server, path, None, content=body, headers={"Content-Type": "application/json"})
    assert "surrogate" in assert_error_shape(r, 400, field)["message"]


def test_3_denormal_temperature_is_greedy(server):
    greedy = complete(server, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert greedy
    for t in (1e-40, 1e-30, 9e-6):
        assert complete(server, prompt=PROMPT, max_tokens=10, temperature=t, seed=3,
                        extra_body={"ignore_eos": True}) == greedy


def test_4_n_choices_are_admitted_together(server):
    """n=4 with max_tokens=1 is one prefill step for all four, not four steps one after another."""
    engine, real, real_emit, steps, emitted = server.engine, server.engine.step, server.engine.emit, [], []

    def counting():  # a step's outputs: those streamed before drafting (`Engine.emit`) and those returned
        emitted.clear()
        out = real()
        if emitted or out:
            steps.append(len(emitted) + len(out))
        return out

    engine.emit = lambda outs: (emitted.extend(outs), real_emit(outs))
    engine.step = counting
    try:
        r = server.client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=1, temperature=0.8, seed=1)
    finally:
        del engine.step
        engine.emit = real_emit
    assert len(r.choices) == 4 and steps == [4], steps


def test_5_tokenizing_runs_off_the_event_loop_and_bodies_are_capped(server):
    completions, started, release = server.completions, threading.Event(), threading.Event()
    real = completions.prompt_ids

    def slow_tokenizer(req):
        started.set()
        release.wait(10)
        return real(req)

    completions.prompt_ids = slow_tokenizer
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert started.wait(10)
            health = httpx.get(server.url + "/health", timeout=5)  # answered while the tokenizer is busy
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            release.set()
            assert pending.result().status_code == 200
    finally:
        release.set()
        del completions.prompt_ids
    big = {"prompt": "x" * (LIMITS["max_body_bytes"] + 1)}
    assert_error_shape(post(server, "/v1/completions", big), 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b" " * 1024
    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={**AUTH, "Content-Type":
                   "application/json"}, timeout=30)
    assert_error_shape(r, 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_7_the_openapi_schema_tells_the_truth(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "429", "503"} <= set(responses), path
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"minLength": 1} .items() <= next(v for v in request["prompt"]["anyOf"] if v["type"] == "string").items()
    bound = lambda name: next(v for v in request[name]["anyOf"] if v["type"] == "integer")["maximum"]  # noqa: E731
    assert bound("top_k") == 2**31 - 1 and bound("n") == 128  # nullable: null is the default (issue 43)
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert_error_shape(post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")  # the schema says so too
    health = httpx.get(server.url + "/health")
    assert health.headers["content-type"] == "application/json"
    r = httpx.delete(server.url + "/v1/completions", headers=AUTH)
    assert_error_shape(r, 405)
    assert r.headers["allow"] == "POST"


# ---- the weaker points ------------------------------------------------------------------------------------------
def test_default_max_tokens_request_ids_and_bearer_case(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True, "temperature": 0},
             headers={"X-Request-ID": "client-id-42"})
    assert r.json()["usage"]["completion_tokens"] == LIMITS["default_max_tokens"]
    assert r.headers["x-request-id"] == "client-id-42"
    odd = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Request-ID": "a b\x7f"})
    assert odd.status_code == 200 and odd.headers["x-request-id"] != "a b\x7f"  # not echoed: a fresh id
    lower = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={"Authorization": f"bearer {KEY}"}, timeout=30)
    assert lower.status_code == 200


def test_a_full_queue_is_a_429_with_retry_after(server):
    capacity = server.engine.config.max_num_seqs + LIMITS["max_queue_len"]
    with slow_steps(server.engine, 0.05), ThreadPoolExecutor(3) as pool:
        first = [pool.submit(post, server, "/v1/completions", {**LONG, "max_tokens": 10, "n": capacity // 2})
                 for _ in range(2)]
        time.sleep(0.3)
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert all(f.result().status_code == 200 for f in first)
    assert_error_shape(r, 429)["type"] == "rate_limit_error"
    assert r.headers["retry-after"] == "1"
    wait_idle(server.engine)
    assert server.completions.admitted == 0


def test_a_request_that_makes_the_engine_fail_is_a_400_and_the_rest_are_unaffected(server):
    """The fault suite's poisoned request: its seed makes the step raise. It alone fails (a 400, or an
    in-band error on a stream); concurrent streams get what they get alone."""
    bodies = [dict(prompt=PROMPT[:k + 8], max_tokens=20, temperature=t, seed=k, ignore_eos=True)
              for k, t in enumerate([0, 0.8, 1.0])]
    alone = [stream_text(server, b)[0] for b in bodies]
    verifier, real = server.engine.verifier, server.engine.verifier.verify

    def poisoned(batch, forward):
        if any(s.seq.seed == 666 for s in batch):
            raise ValueError("injected: this request's data breaks the step")
        return real(batch, forward)

    verifier.verify = poisoned
    try:
        with slow_steps(server.engine, 0.01), ThreadPoolExecutor(5) as pool:
            streams = [pool.submit(stream_text, server, b) for b in bodies]
            time.sleep(0.1)
            bad = pool.submit(post, server, "/v1/completions", {"prompt": "poison", "seed": 666, "max_tokens": 5})
            bad_stream = pool.submit(stream_text, server, {"prompt": "poison", "seed": 666, "max_tokens": 5})
            got = [f.result()[0] for f in streams]
            err = assert_error_shape(bad.result(), 400)
            _, events = bad_stream.result()
    finally:
        del verifier.verify
    assert got == alone
    assert err["code"] == "request_failed" and "injected" not in err["message"]
    assert json.loads(events[-2])["error"]["code"] == "request_failed" and events[-1] == "[DONE]"
    wait_idle(server.engine)


def test_disconnect_storm_returns_every_block_and_gauge(server):
    def leave_after(k: int):
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "max_tokens": 60, "stream": True},
                          headers=AUTH, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= k:
                    return

    with slow_steps(server.engine, 0.01), ThreadPoolExecutor(8) as pool:
        list(pool.map(leave_after, [0, 1, 2, 3, 5, 8, 13, 21] * 2))
    wait_idle(server.engine)
    metrics = httpx.get(server.url + "/metrics").text
    for gauge in ("tsengine:num_requests_running", "tsengine:num_requests_waiting", "tsengine:kv_cache_usage_perc"):
        assert f"{gauge} 0.0" in metrics, gauge
    assert server.completions.admitted == 0 and not server.completions.open


def test_kv_exhaustion_queues_and_preempts_without_changing_outputs(tiny_dirs, head_dir):
    bodies = [dict(prompt=PROMPT[:k + 8], max_tokens=40, temperature=t, seed=k, ignore_eos=True)
              for k, t in enumerate([0, 0.8, 1.0, 0])]
    with serving(config(tiny_dirs, head_dir, num_kv_blocks=40), MODEL, KEY, **LIMITS) as small:
        alone = [stream_text(small, b)[0] for b in bodies]
        with ThreadPoolExecutor(4) as pool:
            together = [t for t, _ in pool.map(lambda b: stream_text(small, b), bodies)]
        assert together == alone
        wait_idle(small.engine)


def test_a_slow_header_client_is_cut_and_others_are_served(server):
    """A client trickling its headers one byte at a time is closed at the header deadline (1 s here)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(0.2)
    t0, closed = time.monotonic(), False
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        while not closed and time.monotonic() - t0 < 5:
            try:
                sock.sendall(b"X")
                closed = sock.recv(1) == b""
            except socket.timeout:
                pass
            except OSError:
                closed = True
        assert closed, "the trickling connection was never closed"
        assert time.monotonic() - t0 >= LIMITS["header_timeout_s"] * 0.9
    finally:
        sock.close()
    assert complete(server, prompt="x", max_tokens=1)


def test_a_client_that_stops_reading_does_not_stall_others(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({**LONG, "max_tokens": 100, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:  # never read: its stream backs up; another request still completes
        assert complete(server, prompt=PROMPT, max_tokens=5, temperature=0)
    finally:
        sock.close()
    wait_idle(server.engine)
