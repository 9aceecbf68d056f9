"""A hostile-but-fair client against `tsengine serve` on loopback: the probe list of issue 14.

Starts the server itself (so it can also send SIGTERM at the end), runs every probe, prints one line per
probe and the totals. `--checkout DIR` runs another revision's server (its own `python -m tsengine.entrypoints.cli`),
so old and new answer the same probes. Only flags every revision has are passed.

    python bench/probe_server.py --model smollm2-135m [--spec-head runs/smollm2-135m/export] [--checkout DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

RESULTS: list[tuple[str, bool, str]] = []


def probe(name: str):
    def wrap(fn):
        def run(url):
            try:
                ok, note = fn(url)
            except Exception as e:  # a probe that crashes is a failed probe, with its reason
                ok, note = False, f"{type(e).__name__}: {e}"[:160]
            RESULTS.append((name, bool(ok), note))
            print(f"{'PASS' if ok else 'FAIL'}  {name}  {note}", flush=True)
        PROBES.append(run)
        return run
    return wrap


PROBES: list = []


def post(url, path, body=None, content=None, headers=None, timeout=120):
    kw = {"content": content} if content is not None else {"json": body}
    return httpx.post(url + path, headers={"Content-Type": "application/json", **(headers or {})},
                      timeout=timeout, **kw)


def is_error_shape(r) -> bool:
    try:
        err = r.json()["error"]
        return set(err) >= {"message", "type", "param", "code"} and "Traceback" not in r.text
    except Exception:
        return False


def stream(url, body) -> tuple[str, list[str]]:
    text, events = "", []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if line != "data: [DONE]":
                    ev = json.loads(line[6:])
                    text += "".join(c.get("text", "") for c in ev.get("choices", []))
    return text, events


LONG = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 48, "temperature": 0,
        "ignore_eos": True}


# ---- the eight failures ------------------------------------------------------------------------------------
@probe("1 top_k 2**63 is a 4xx and a concurrent stream is untouched")
def _(url):
    alone, _ = stream(url, LONG)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(stream, url, LONG)
        time.sleep(0.5)
        r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0.5,
                                          "top_k": 9223372036854775808})
        text, events = other.result()
    intact = text == alone and events[-1] == "[DONE]" and '"error"' not in "".join(events)
    return r.status_code < 500 and intact, f"status {r.status_code}, concurrent stream intact: {intact}"


for _where, _body in [("prompt", b'{"prompt": "hi \\ud800", "max_tokens": 2}'),
                      ("chat content", b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}')]:
    @probe(f"2 lone surrogate in {_where} is a 4xx")
    def _(url, body=_body):
        r = post(url, "/v1/completions" if b"prompt" in body else "/v1/chat/completions", content=body)
        return 400 <= r.status_code < 500 and is_error_shape(r), f"status {r.status_code}"


@probe("3 temperature 1e-40 answers the greedy text")
def _(url):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True}
    greedy = post(url, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    tiny = post(url, "/v1/completions", {**body, "temperature": 1e-40}).json()["choices"][0]["text"]
    return tiny == greedy and greedy != "", f"greedy {greedy!r}, 1e-40 {tiny!r}"


@probe("4 n=8 costs about one request (max_tokens=1)")
def _(url):
    body = {"prompt": "Hello there, how are", "max_tokens": 1, "temperature": 0.7, "seed": 1}
    times = {}
    for n in (1, 8, 1, 8):
        t0 = time.perf_counter()
        post(url, "/v1/completions", {**body, "n": n}).raise_for_status()
        times.setdefault(n, []).append(time.perf_counter() - t0)
    ratio = min(times[8]) / min(times[1])
    return ratio < 3, f"n=8 / n=1 wall time: {ratio:.1f}x"


@probe("5 /health stays fast while a 5 MB prompt is tokenized")
def _(url):
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, url, "/v1/completions", {"prompt": "word " * 1_000_000, "max_tokens": 1})
        time.sleep(0.3)
        worst = 0.0
        while not big.done():
            t0 = time.perf_counter()
            httpx.get(url + "/health", timeout=60)
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.2)
        r = big.result()
    return worst < 1.0 and r.status_code < 500, f"slowest /health {worst:.2f} s; big prompt: {r.status_code}"


@probe("5b a 50 MB body is refused (413) without reading it all")
def _(url):
    r = post(url, "/v1/completions", content=b"{" + b" " * 50_000_000 + b"}")
    return r.status_code == 413 and is_error_shape(r), f"status {r.status_code}"


@probe("7 /openapi.json: no 422, errors documented, /health JSON, /metrics text/plain, 405 Allow")
def _(url):
    schema = httpx.get(url + "/openapi.json").json()
    ops = [schema["paths"][p]["post"]["responses"] for p in ("/v1/completions", "/v1/chat/completions")]
    no422 = all("422" not in o for o in ops)
    has400 = all("400" in o and "503" in o for o in ops)
    empty = post(url, "/v1/completions", {"prompt": ""})
    prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    empty_consistent = empty.status_code == 400 and "minLength" in json.dumps(prompt)
    health = httpx.get(url + "/health")
    health_json = health.headers.get("content-type", "").startswith("application/json")
    metrics_doc = "text/plain" in json.dumps(schema["paths"]["/metrics"])
    r405 = httpx.delete(url + "/v1/completions")
    allow = r405.status_code == 405 and "allow" in r405.headers
    checks = dict(no422=no422, errors_documented=has400, empty_prompt_consistent=empty_consistent,
                  health_json=health_json, metrics_documented=metrics_doc, allow_header=allow)
    return all(checks.values()), " ".join(f"{k}={int(v)}" for k, v in checks.items())


# ---- the weaker points --------------------------------------------------------------------------------------
@probe("a request without max_tokens is capped by a default")
def _(url):
    r = post(url, "/v1/completions", {"prompt": "Count forever: 1, 2, 3,", "temperature": 0, "ignore_eos": True})
    used = r.json()["usage"]["completion_tokens"]
    return used <= 1024, f"{used} tokens"


@probe("X-Request-ID is echoed")
def _(url):
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Request-ID": "probe-7"})
    return r.headers.get("x-request-id") == "probe-7", f"header {r.headers.get('x-request-id')!r}"


@probe("the model id is a name, not a filesystem path")
def _(url):
    mid = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return "/" not in mid or not os.path.exists(mid), f"id {mid!r}"


@probe("a slow-header client is closed")
def _(url):
    host, port = url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(0.5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0, closed = time.monotonic(), False
    while not closed and time.monotonic() - t0 < 20:
        try:
            sock.sendall(b"X")
            closed = sock.recv(1) == b""
        except socket.timeout:
            pass
        except OSError:
            closed = True
    sock.close()
    return closed, f"closed after {time.monotonic() - t0:.1f} s" if closed else "still open after 20 s"


@probe("malformed requests are 4xx in OpenAI's shape (25 bodies)")
def _(url):
    bodies = [b"{not json", b"", b"[]", b"null", b'"x"', b'{"prompt": 5}', b'{"prompt": null}', b'{"prompt": [-1]}',
              b'{"prompt": [1e40]}', b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": "x", "n": 1000}',
              b'{"prompt": "x", "seed": 99999999999999999999}', b'{"prompt": "x", "temperature": NaN}',
              b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", '
              b'"p", "q"]}',
              b'{"prompt": "x", "stop_token_ids": [99999999999]}', b'{"prompt": "x", "top_p": -1}',
              b'{"prompt": "x", "logit_bias": {"5": 100}}', b'{"prompt": "x", "stream_options": 3}',
              b'{"messages": "hi"}', b'{"messages": [{"role": "user"}], "max_tokens": 0}',
              b'{"prompt": "x", "min_p": 2}', b'{"prompt": "x", "top_k": -2}',
              b'{"prompt": "\\u0000", "max_tokens": "1"}', b'{"prompt": "x", "user": 5}',
              b'{"prompt": "x", "model": 1}']
    bad = [b for b in bodies if not (400 <= (r := post(url, "/v1/completions", content=b)).status_code < 500
                                      and is_error_shape(r))]
    return not bad, f"{len(bodies) - len(bad)}/{len(bodies)} ok" + (f"; first bad: {bad[0][:60]!r}" if bad else "")


@probe("disconnect storm: KV usage and running/waiting gauges return to zero")
def _(url):
    def leave(k):
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= k:
                    return
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(leave, [0, 1, 2, 3, 5, 8, 13, 21]))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = httpx.get(url + "/metrics").text
        if all(f"{g} 0.0" in m for g in ("tsengine:num_requests_running", "tsengine:kv_cache_usage_perc")):
            return True, "all zero"
        time.sleep(0.2)
    return False, "gauges not back to zero"


def sigterm_probe(proc, url) -> None:
    started = []

    def watch():
        out = []
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "max_tokens": 400, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.append(1)
        return out

    with ThreadPoolExecutor(1) as pool:
        f = pool.submit(watch)
        while len(started) < 3:
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(45)
        except subprocess.TimeoutExpired:
            pass
        alive = proc.poll() is None
        try:
            events = f.result(5)
            closed = events[-1] == "[DONE]"
        except Exception:
            closed = False
    ok = not alive and closed
    note = f"exited in {time.monotonic() - t0:.1f} s, stream ended with [DONE]: {closed}" if not alive \
        else "still alive 45 s after SIGTERM"
    RESULTS.append(("6 SIGTERM during a stream: bounded exit, the stream closed with [DONE]", ok, note))
    print(f"{'PASS' if ok else 'FAIL'}  6 SIGTERM during a stream  {note}", flush=True)
    if alive:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec-head", help="EAGLE-3 head directory (speculate with it)")
    ap.add_argument("--checkout", help="run the server from this checkout instead (for an old-vs-new run)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "tsengine.entrypoints.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-model-len", str(args.max_model_len)]
    if args.spec_head:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.spec_head,
                "--speculative-num-steps", "3"]
    cwd = args.checkout or os.getcwd()
    log = open(os.path.join("/tmp", f"probe-server-{port}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": cwd})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"server did not start; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    print(f"server: {' '.join(cmd)} (cwd {cwd}); log {log.name}", flush=True)
    for run in PROBES:
        run(url)
    sigterm_probe(proc, url)
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"probes: {passed} passed, {len(RESULTS) - passed} failed")


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # a probe's helper thread dying is reported by the probe
    main()
