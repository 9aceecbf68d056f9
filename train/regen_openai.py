"""Regeneration on OpenAI-compatible servers (`regen.backend: openai`): vLLM, SGLang or `tsengine serve`.

When one machine is not enough to generate the data, the answers come from servers built for scale, as
vLLM's speculators generates from vLLM and SpecForge from SGLang; the target's features are then captured
by the offline feature pass over the answers (train/dump_features.py, split across ranks as for the HF
backend). The same recipe scales from this box to a fleet by listing servers in `regen.base_urls`.

Conversations are state machines as in the engine backend (train/regen_engine.py): turn r is asked once
turn r-1's reply is in. They are dealt to the servers in turn, `regen.batch_size` in flight per server, so
the servers share the work (data parallel). Each request carries its own seed (`request_seed`, from the
recipe seed and the row id), which `tsengine serve` and vLLM honour: at temperature 0 `tsengine serve`
answers exactly what the in-process engine answers (tests/train/test_regen_openai.py). Records are appended
by row id as conversations finish, so a restart skips every id already written.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

import httpx
from tqdm import tqdm

from tsengine.errors import UserError
from tsengine.train.data import Skipped
from tsengine.train.regen_engine import request_seed
from tsengine.train.regenerate import pending, read_done, reply_slots

RETRIES = 4  # a dropped connection or a 5xx/429 is retried with backoff; then the run stops (answers kept)
API_KEY_ENV = "OPENAI_API_KEY"  # read from the environment, never from a recipe file


class OpenAIRegenerator:
    def __init__(self, base_urls: list[str], model: str | None = None, concurrency: int = 32,
                 max_new_tokens: int = 256, top_p: float = 1.0, seed: int = 0, timeout_s: float = 600.0):
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in base_urls]
        self.model, self.concurrency, self.max_new_tokens = model, concurrency, max_new_tokens
        self.top_p, self.seed, self.timeout_s = top_p, seed, timeout_s
        key = os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.tokens_out = 0

    def run(self, rows: Iterable[dict[str, Any]], out_path: str | Path, progress: bool = True) -> Skipped:
        """Answer every row not yet in `out_path` (JSONL); a row may carry `temperature` (else greedy)."""
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        skipped = Skipped()
        todo = [(rid, msgs, float(row.get("temperature") or 0.0))
                for rid, row, msgs in pending(rows, read_done(out_path), skipped)]
        if todo:
            asyncio.run(self._run(todo, out_path, skipped, progress))
        return skipped

    async def _run(self, todo: list, out_path: Path, skipped: Skipped, progress: bool) -> None:
        limits = httpx.Limits(max_connections=self.concurrency * len(self.urls))
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers, limits=limits) as client:
            model = self.model or await self._served_model(client)
            queues = [asyncio.Queue() for _ in self.urls]
            for j, conv in enumerate(todo):  # dealt in turn: each server gets every len(urls)-th conversation
                queues[j % len(self.urls)].put_nowait(conv)
            bar = tqdm(total=len(todo), desc="regenerate[openai]", unit="conv", disable=not progress)
            with out_path.open("a") as jsonl:
                t0 = time.time()

                async def worker(url: str, queue: asyncio.Queue) -> None:
                    while not queue.empty():
                        rid, msgs, temperature = queue.get_nowait()
                        record = await self._conversation(client, url, model, rid, msgs, temperature, skipped)
                        if record is not None:
                            jsonl.write(json.dumps(record, ensure_ascii=False) + "\n")
                            jsonl.flush()
                            os.fsync(jsonl.fileno())
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{self.tokens_out / max(time.time() - t0, 1e-9):.0f}", refresh=False)

                await asyncio.gather(*(worker(url, q) for url, q in zip(self.urls, queues)
                                       for _ in range(self.concurrency)))
            bar.close()

    async def _served_model(self, client: httpx.AsyncClient) -> str:
        """The model every server serves (regen.model unset): the first of each /v1/models, all the same."""
        names = []
        for url in self.urls:
            r = await self._request(client, "GET", f"{url}/v1/models")
            names.append(r.json()["data"][0]["id"])
        if len(set(names)) > 1:
            raise UserError(f"regen.base_urls serve different models {dict(zip(self.urls, names))}; set regen.model")
        return names[0]

    async def _conversation(self, client, url: str, model: str, rid: str, msgs: list[dict[str, str]],
                            temperature: float, skipped: Skipped) -> dict | None:
        finished = True
        for turn, at in enumerate(reply_slots(msgs)):
            body = {"model": model, "messages": msgs[:at], "max_tokens": self.max_new_tokens,
                    "temperature": temperature, "top_p": self.top_p if temperature > 0 else 1.0,
                    "seed": request_seed(self.seed, f"{rid}/{turn}") % 2**63}
            r = await self._request(client, "POST", f"{url}/v1/chat/completions", body)
            if r.status_code >= 400:  # the server refused this conversation (too long, ...): skip it
                skipped.add(f"refused by the server ({r.status_code})")
                return None
            choice = r.json()["choices"][0]
            text = (choice["message"].get("content") or "").strip()  # as the other backends keep it
            self.tokens_out += (r.json().get("usage") or {}).get("completion_tokens", 0)
            if not text:
                skipped.add("empty response")
                return None
            finished = finished and choice.get("finish_reason") == "stop"
            msgs = msgs[:at] + [{"role": "assistant", "content": text}] + msgs[at + 1:]
        return {"id": rid, "messages": msgs, "finished": finished}

    async def _request(self, client, method: str, url: str, body: dict | None = None) -> httpx.Response:
        """The response, 4xx included (the caller decides); a dropped connection, 5xx or 429 retried with
        backoff, then a UserError naming the server (answers written so far are kept)."""
        why = ""
        for attempt in range(RETRIES + 1):
            try:
                r = await client.request(method, url, json=body)
                if r.status_code < 500 and r.status_code != 429:
                    if r.status_code in (401, 403, 404):
                        raise UserError(f"regen.base_urls: {url} answered {r.status_code} ({r.text[:200]}); "
                                        f"check the URL, regen.model and {API_KEY_ENV}")
                    return r
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if attempt < RETRIES:
                await asyncio.sleep(min(2 ** attempt, 30))
        raise UserError(f"regen.base_urls: {url} failed {RETRIES + 1} times ({why}); answers so far are kept, "
                        "a rerun resumes")
