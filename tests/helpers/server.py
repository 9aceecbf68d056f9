"""The OpenAI server on a loopback port, and waiting on its engine."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import uvicorn

from tsengine.engine.core import Engine
from tsengine.entrypoints.openai.app import build_app
from tsengine.entrypoints.openai.async_engine import AsyncEngine
from tsengine.entrypoints.openai.guards import header_deadline_protocol
from tsengine.entrypoints.openai.settings import ServerSettings


@contextlib.contextmanager
def serving(config, model_name: str, api_key: str | None, **settings):
    """`build_app` behind uvicorn on a free loopback port, the engine built on its own thread as
    `tsengine serve` builds it."""
    engine = AsyncEngine(lambda: Engine(config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server_settings = ServerSettings(model_name=model_name, api_key=api_key, **settings)
    app = build_app(engine, server_settings)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                       http=header_deadline_protocol(server_settings.header_timeout_s)))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield SimpleNamespace(url=url, engine=engine.engine, async_engine=engine, completions=app.state.server,
                              port=sock.getsockname()[1],
                              client=openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0,
                                                   timeout=30))
    finally:
        uv.should_exit = True
        thread.join(10)
        engine.shutdown()
        sock.close()


def post(server, path: str, body, key: str | None = "sk-test", headers: dict | None = None, **kw) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    kw = {"json": body} if "content" not in kw else kw
    return httpx.post(server.url + path, headers=headers, timeout=30, **kw)


def wait_idle(engine, timeout: float = 10.0) -> None:
    """The engine has no request left and every KV block is free again."""
    blocks, deadline = engine.runner.blocks, time.monotonic() + timeout
    while engine.has_unfinished() or blocks.num_free != blocks.num_blocks:
        assert time.monotonic() < deadline, (f"{blocks.num_blocks - blocks.num_free} blocks still held, "
                                             f"unfinished={engine.has_unfinished()}")
        time.sleep(0.02)


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.05):
    """Every engine step takes at least `seconds`: a long request is surely still running when the client
    leaves, so finishing early proves the abort."""
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.step = step
    try:
        yield
    finally:
        del engine.step
