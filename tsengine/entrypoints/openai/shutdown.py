"""Bounded, graceful shutdown: the first SIGTERM/SIGINT drains, a second one exits at once.

On the first signal the server stops admitting (new requests get a 503 `server_shutting_down` and /health
says so), lets open requests finish for up to `drain_timeout_s`, then ends every request still open: each
choice finishes with finish_reason "abort" (vLLM's name for a request the server stopped), a stream gets
its final chunk and `data: [DONE]`, a plain request its partial completion. A request still waiting for
the tokenizer pool is open too: it gets the 503, and the pool's queue is dropped (no exit waits for it).
Then uvicorn closes the connections and the process exits 0. uvicorn's own handling would wait for every
stream to end by itself, however long, ignore a second SIGTERM, and answer a request it cancels with a
plain-text 500.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from tsengine.entrypoints.openai.guards import header_deadline_protocol
from tsengine.entrypoints.openai.settings import ServerSettings

log = logging.getLogger("tsengine.entrypoints.openai.app")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, completions, drain_timeout_s: float):
        super().__init__(config)
        self.completions, self.drain_timeout_s = completions, drain_timeout_s
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:  # runs in the signal handler: hand the work to the loop
        if self.draining or self._loop is None:
            log.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.completions.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain()))

    async def drain(self) -> None:
        c = self.completions
        log.info("shutting down: %d request(s) open, %d of them tokenizing; up to %.1f s to finish",
                 len(c.open) + len(c.tokenizing), len(c.tokenizing), self.drain_timeout_s)
        deadline = time.monotonic() + self.drain_timeout_s
        while c.busy and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        cut = c.stop_all()
        if cut:
            log.warning("drain timeout: %d request(s) end with finish_reason 'abort' (or a 503 if still "
                        "tokenizing)", cut)
        c.close()  # drops the tokenizations still queued
        while c.busy and not self.force_exit:  # each stream sends its last chunk and [DONE]
            await asyncio.sleep(0.02)
        self.should_exit = True


def run_until_drained(app, settings: ServerSettings, host: str, port: int) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            http=header_deadline_protocol(settings.header_timeout_s),
                            timeout_graceful_shutdown=2)  # backstop after the drain: connections close
    try:
        DrainingServer(config, app.state.server, settings.drain_timeout_s).run()
    finally:  # also after a second signal, which skips the drain
        app.state.server.close()
