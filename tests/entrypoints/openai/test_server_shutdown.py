"""`tsengine serve` under SIGTERM (issue 14): a bounded drain, every open stream closed properly, exit 0; a
second signal exits at once; requests still tokenizing are open for the drain and end in JSON, and the
tokenizer pool does not hold the exit (issue 43 item 2). A real process: uvicorn listens for signals only on
its main thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


@pytest.fixture
def serve_process(tiny_dirs):
    procs = []

    def start(*flags: str):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        proc = subprocess.Popen([sys.executable, "-m", "tsengine.entrypoints.cli", "serve",
                                 "--model", str(tiny_dirs["llama"]),
                                 "--max-model-len", "512", "--port", str(port), *flags],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(proc)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(0.2)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def stream_events(url: str, started: list) -> list[str]:
    body = {"prompt": "the water is hot and", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.append(1)
    except httpx.HTTPError as e:  # a cut connection: recorded, the test fails on it
        events.append(f"cut: {e!r}")
    return events


def test_sigterm_drains_then_closes_every_stream_and_exits(serve_process):
    proc, url = serve_process("--drain-timeout", "0.5", "--max-num-seqs", "4")
    started: list = []
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_events, url, started) for _ in range(3)]
        while len(started) < 6:
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        results = [f.result(30) for f in streams]
    assert proc.wait(30) == 0
    assert time.monotonic() - t0 < 15, "shutdown was not bounded"
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] in ("abort", "length"), last
    assert any(json.loads(e[-2])["choices"][0]["finish_reason"] == "abort" for e in results), \
        "480 tokens each finished inside the 0.5 s drain: nothing was cut"


def test_a_second_signal_exits_at_once(serve_process):
    proc, url = serve_process("--drain-timeout", "60")
    started: list = []
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_events, url, started)
        while len(started) < 3:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None  # draining: the stream may still finish
        assert httpx.get(url + "/health", timeout=5).status_code == 503  # stops admitting, and says so
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        assert time.monotonic() - t0 < 10
        stream.result(30)


def answer(url: str, body: dict) -> tuple[int | None, str, str]:
    """Status, content type and the whole text of a completion, streamed or not (None: no answer)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            return r.status_code, r.headers.get("content-type", ""), r.read().decode()
    except httpx.HTTPError as e:
        return None, "", repr(e)


def assert_clean(status: int | None, ctype: str, text: str) -> None:
    """A completion (finished or aborted), a 400 for a prompt over the context, or OpenAI's shutdown 503:
    JSON (or SSE ending in [DONE]), never uvicorn's plain-text 500."""
    assert status in (200, 400, 503), (status, ctype, text[:300])
    if ctype.startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        return
    assert ctype == "application/json", (status, ctype, text[:300])
    body = json.loads(text)
    if status == 503:
        assert body["error"]["code"] == "server_shutting_down", body
    elif status == 400:
        assert body["error"]["param"] == "prompt", body


def test_sigterm_while_prompts_tokenize_answers_each_in_json_and_exits_after_the_drain(serve_process):
    """Issue 43 item 2. Requests admitted but still waiting for the tokenizer pool were not open for the
    drain: it ended at once, uvicorn cancelled them 2 s later and each got a plain-text 500 (the 5 MB
    prompts, and a stream and a plain request queued behind them), and the process lived on until the pool
    had tokenized its whole queue. Now each finishes within the drain or gets a 503 `server_shutting_down`,
    and the process exits right after the drain."""
    drain = 2.0
    proc, url = serve_process("--drain-timeout", str(drain))
    big = {"prompt": "the water is hot and the sky is blue. " * (5 * 2**20 // 38), "max_tokens": 1}  # seconds
    small = {"prompt": "the water is hot and", "max_tokens": 8, "temperature": 0}  # each to tokenize (5 MB)
    with ThreadPoolExecutor(8) as pool:
        bigs = [pool.submit(answer, url, big) for _ in range(6)]  # two tokenizer threads: three rounds
        time.sleep(1.0)
        queued = [pool.submit(answer, url, {**small, "stream": True}), pool.submit(answer, url, small)]
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            while httpx.get(url + "/health", timeout=5).status_code != 503:
                time.sleep(0.01)
        except httpx.HTTPError:  # the server stopped listening already: `late` fails below
            pass
        late = answer(url, small)  # after the signal
        results = [f.result(60) for f in bigs + queued]
    for status, ctype, text in results:
        assert_clean(status, ctype, text)
    assert late[0] == 503, late
    assert_clean(*late)
    try:
        assert proc.wait(max(t0 + drain + 5 - time.monotonic(), 0.1)) == 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {drain + 5:g} s after SIGTERM")
    log = proc.stdout.read()
    tokenizing = re.search(r"shutting down: \d+ request\(s\) open, (\d+) of them tokenizing", log)
    assert tokenizing and int(tokenizing[1]) >= 1, "nothing was tokenizing at SIGTERM: the test tested nothing"


def test_a_request_uvicorn_cancels_on_shutdown_gets_a_json_503():
    """uvicorn cancels what still runs `timeout_graceful_shutdown` after the drain (a request whose body is
    still arriving, say) and answers it with a plain-text 500 unless the app answers: ShutdownCancel does,
    with the 503 `server_shutting_down`. A response already started is left to uvicorn (it closes the
    connection)."""
    from tsengine.entrypoints.openai.guards import ShutdownCancel

    async def run(start_first: bool) -> tuple[list[dict], BaseException | None]:
        async def app(scope, receive, send):
            if start_first:
                await send({"type": "http.response.start", "status": 200, "headers": []})
            await asyncio.Event().wait()  # a body that never arrives, a stream that never ends

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        async def receive():
            await asyncio.Event().wait()

        task = asyncio.ensure_future(ShutdownCancel(app)({"type": "http", "headers": []}, receive, send))
        await asyncio.sleep(0.01)
        task.cancel()
        error = (await asyncio.gather(task, return_exceptions=True))[0]
        return sent, error

    sent, error = asyncio.run(run(start_first=False))
    assert error is None
    assert sent[0]["status"] == 503 and (b"content-type", b"application/json") in sent[0]["headers"], sent
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_shutting_down"
    sent, error = asyncio.run(run(start_first=True))
    assert isinstance(error, asyncio.CancelledError) and len(sent) == 1


def test_the_tokenizer_pool_shuts_down_without_waiting():
    """Queued calls are cancelled, a running one is not waited for (its thread is a daemon, so the process
    can exit under it), and a call after shutdown comes back cancelled. A ThreadPoolExecutor's threads are
    joined at exit after they ran their whole queue."""
    from tsengine.entrypoints.openai.completions import TokenizerPool

    pool, release = TokenizerPool(1, "test-tokenize"), threading.Event()
    running = pool.submit(release.wait, 30)
    queued = [pool.submit(time.sleep, 30) for _ in range(3)]
    while not running.running():
        time.sleep(0.01)
    t0 = time.monotonic()
    pool.shutdown()
    assert time.monotonic() - t0 < 1
    assert all(f.cancelled() for f in queued) and pool.submit(len, "x").cancelled()
    threads = [t for t in threading.enumerate() if t.name.startswith("test-tokenize")]
    assert threads and all(t.daemon for t in threads)
    release.set()
    assert running.result(5) is True
