"""Regeneration through tsengine's engine: continuous batching, chunked prefill, features captured in passing.

HF `generate` pads a batch to its longest prompt and runs until its longest answer ends; the engine
admits a new conversation the moment one finishes, so every step runs full. With `capture`, the last
reply's request keeps the target's features of every position it forwarded (tsengine/engine/capture.py), and
each finished conversation goes straight into the offline feature store with the exact token ids the
target ran (train/data.captured_example): no second target pass.

Conversations are state machines: turn r's request is admitted when turn r-1's reply is in, so a
multi-turn row never waits for a batch. Only the last turn is captured: its prompt holds the earlier
turns as the template renders them (re-tokenized, and exactly what the target conditioned on).

Resumable by row id: without capture, a JSONL line per finished conversation; with capture, shards of
`capture_shard_tokens` whose sidecars carry the ids, masks and messages (train/features.ShardWriter).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tqdm import tqdm

from tsengine.train.data import Skipped, captured_example, normalize, render
from tsengine.train.regenerate import read_done, reply_slots, row_id

CAPTURE_SHARD_TOKENS = 32768  # small shards: a killed run loses at most this much generation


def request_seed(seed: int, rid: str) -> int:
    """Each answer's own sampling stream, from the recipe seed and the row id: reproducible whatever the
    batch composition, order or restarts (the engine keys its draws by (seed, position))."""
    return int(hashlib.sha256(f"{seed}/{rid}".encode()).hexdigest()[:15], 16)


@dataclass
class _Conversation:
    rid: str
    messages: list[dict[str, str]]
    slots: list[int]  # message indexes of the replies to write, in order
    temperature: float
    turn: int = 0
    finished: bool = True
    prompt_ids: list[int] = field(default_factory=list)
    answer: list[int] = field(default_factory=list)


class EngineRegenerator:
    """`capture_layer_ids`: capture the features of these target layers; `run(writer=...)` then receives
    each finished conversation's features with its ids, mask and messages. `engine_args` go to the
    engine (block_size, num_kv_blocks, max_num_batched_tokens, ...)."""

    def __init__(self, target: str, tok, max_num_seqs: int = 32, max_new_tokens: int = 256, top_p: float = 1.0,
                 seed: int = 0, max_length: int | None = None, capture_layer_ids: tuple[int, ...] | None = None,
                 **engine_args):
        from tsengine.config import EngineConfig
        from tsengine.engine.core import Engine

        self.tok, self.max_new_tokens, self.top_p = tok, max_new_tokens, top_p
        self.seed, self.max_length = seed, max_length
        self.capture = bool(capture_layer_ids)
        from tsengine.errors import UserError

        try:
            self.engine = Engine(EngineConfig.make(model=target, max_num_seqs=max_num_seqs, max_model_len=max_length,
                                                   capture_layer_ids=tuple(capture_layer_ids) if self.capture else None,
                                                   **engine_args))
        except UserError as e:  # never a silent fall back to HF: the user picks it
            raise UserError(f"regen.backend engine: {e}; `regen.backend: hf` regenerates with transformers' "
                            "generate instead") from None
        self.eos = self.engine.eos_ids
        self.tokens_out = 0

    def run(self, rows: Iterable[dict[str, Any]], out_path: str | Path | None = None, writer=None,
            progress: bool = True) -> Skipped:
        """Answer every row not yet done. A row may carry `temperature` (its sampling temperature, else
        greedy). Without capture, records go to `out_path` (JSONL); with capture, to `writer`."""
        from jinja2 import TemplateError

        from tsengine.errors import UserError

        if writer is None:
            out_path = Path(out_path)
            out_path.parent.mkdir(parents=True, exist_ok=True)
        done = ({e for m in writer.existing() for e in m["examples"]} if writer is not None else read_done(out_path))
        skipped, todo, seen = Skipped(), [], set()
        for i, row in enumerate(rows):
            rid = row_id(row, i)
            if rid in done:
                continue
            try:
                msgs = normalize(row, require_assistant=False)
            except ValueError as e:
                skipped.add(str(e))
                continue
            slots = reply_slots(msgs)
            if rid in seen:
                raise UserError(f"rows: id {rid!r} appears twice; every row needs its own id (answers are "
                                "cached and written by id)")
            seen.add(rid)
            todo.append(_Conversation(rid, msgs, slots, float(row.get("temperature") or 0.0)))
        todo.reverse()  # pop() from the end keeps the file's order
        running: dict[str, _Conversation] = {}
        bar = tqdm(total=len(todo), desc="regenerate[engine]", unit="conv", disable=not progress)
        t0, lines = time.time(), []
        with (out_path.open("a") if writer is None else contextlib.nullcontext()) as jsonl:
            while todo or running:
                while todo and len(running) < 2 * self.engine.config.max_num_seqs:  # keep the scheduler's queue fed
                    conv = todo.pop()
                    try:
                        self._admit(conv)
                        running[conv.rid] = conv
                    except (TemplateError, ValueError) as e:
                        skipped.add("rejected by the chat template" if isinstance(e, TemplateError) else str(e))
                        bar.update(1)
                for out in self.engine.step():
                    conv = running[out.request_id.rsplit("/", 1)[0]]
                    conv.answer.extend(out.new_tokens)
                    self.tokens_out += len(out.new_tokens)
                    if not out.finished:
                        continue
                    record = self._reply(conv, out, skipped, writer)
                    if record is None:
                        if conv.turn < len(conv.slots):
                            try:
                                self._admit(conv)
                                continue
                            except (TemplateError, ValueError) as e:
                                skipped.add("rejected by the chat template" if isinstance(e, TemplateError) else str(e))
                    elif writer is None:
                        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                    del running[conv.rid]
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{self.tokens_out / max(time.time() - t0, 1e-9):.0f}", refresh=False)
                if len(lines) >= 16 or (lines and not (todo or running)):
                    jsonl.write("".join(lines))
                    jsonl.flush()
                    os.fsync(jsonl.fileno())
                    lines = []
        if writer is not None:
            writer.flush()
        bar.close()
        return skipped

    def _admit(self, conv: _Conversation) -> None:
        """Turn `conv.turn`'s request: the conversation so far, rendered with the generation prompt."""
        from tsengine.sampling_params import SamplingParams

        text = render(self.tok, conv.messages[:conv.slots[conv.turn]], add_generation_prompt=True)
        conv.prompt_ids, conv.answer = self.tok(text, add_special_tokens=False)["input_ids"], []
        if len(conv.prompt_ids) >= self.engine.max_model_len:  # max_length when given, else the model's
            raise ValueError("over max length")
        t = conv.temperature
        params = SamplingParams(temperature=t, top_p=self.top_p if t > 0 else 1.0, max_tokens=self.max_new_tokens,
                                seed=request_seed(self.seed, f"{conv.rid}/{conv.turn}"))
        last = conv.turn == len(conv.slots) - 1
        self.engine.add_request(f"{conv.rid}/{conv.turn}", conv.prompt_ids, params, capture=self.capture and last)

    def _reply(self, conv: _Conversation, out, skipped: Skipped, writer) -> dict | None:
        """Put the finished reply into the conversation; the record once the last turn is in (None while
        turns remain or when the row is skipped: then `conv.turn` is past the end)."""
        stop = next((j for j, t in enumerate(conv.answer) if t in self.eos), None)
        body = conv.answer if stop is None else conv.answer[:stop]
        text = self.tok.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        conv.finished = conv.finished and stop is not None
        at, conv.turn = conv.slots[conv.turn], conv.turn + 1
        if not text.strip():
            skipped.add("empty response")
            conv.turn = len(conv.slots)
            return None
        # without capture the text is re-tokenized later: strip as the HF backend does; with capture the
        # ids are kept, so the text must be exactly what was decoded
        reply = {"role": "assistant", "content": text if self.capture else text.strip()}
        conv.messages = conv.messages[:at] + [reply] + conv.messages[at + 1:]
        if conv.turn < len(conv.slots):
            return None
        record = {"id": conv.rid, "messages": conv.messages, "finished": conv.finished}
        if writer is not None:
            try:
                ex = captured_example(self.tok, conv.messages, conv.prompt_ids, conv.answer, self.max_length)
            except ValueError as e:
                skipped.add(str(e))
                return None
            cap = out.captured
            assert cap.aux.shape[0] == len(ex.input_ids) - 1, "captured rows != forwarded positions"
            writer.add(conv.rid, cap.aux, cap.final, cap.argmax, input_ids=ex.input_ids, loss_mask=ex.loss_mask,
                       messages=conv.messages, finished=conv.finished)
        return record
