"""Regenerate assistant turns with the target itself, so the head learns the distribution it will draft for.

EAGLE heads trained on someone else's answers (ShareGPT's GPT-4 text) accept less than heads trained on
the target's own outputs. This stage replays every conversation through the target: user (and system)
turns are kept, each assistant turn is replaced by what the target generates given the conversation so
far. Three backends: tsengine's engine (train/regen_engine.py: continuous batching, and in offline mode the
features captured in the same forward), OpenAI-compatible servers (train/regen_openai.py: vLLM, SGLang or
`tsengine serve`, for more than one machine) and, for architectures the engine does not run, batched HF
`generate` with left padding (`Regenerator` here). Rows are appended to a JSONL file as they finish, so a
restart skips every id already written.

    python -m tsengine.train.regenerate --target smollm2-135m --data prompts.jsonl --out regen.jsonl [--backend hf]
    python -m tsengine.train.regenerate --target T --data prompts.jsonl --out regen.jsonl --backend openai \
        --base-url http://host-a:8000/v1 --base-url http://host-b:8000/v1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import torch
from tqdm import tqdm

from tsengine.conversations import load_rows, normalize
from tsengine.errors import UserError, run_main
from tsengine.train.data import Skipped


def row_id(row: dict[str, Any], index: int) -> str:
    return str(row.get("id") if row.get("id") is not None else index)


def reply_slots(msgs: list[dict[str, str]]) -> list[int]:
    """The message indexes a regeneration writes, in order: every assistant turn, and a reply appended to a
    conversation that ends with the user."""
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant"] + (
        [len(msgs)] if msgs[-1]["role"] == "user" else [])


def pending(rows: Iterable[dict[str, Any]], done: set[str], skipped: Skipped):
    """(id, row, normalized messages) of every row not in `done`; malformed rows are counted in `skipped`."""
    for i, row in enumerate(rows):
        rid = row_id(row, i)
        if rid in done:
            continue
        try:
            yield rid, row, normalize(row, require_assistant=False)
        except ValueError as e:
            skipped.add(str(e))


def answer_rows(rows: list[dict[str, Any]], temperature: float, samples: int = 1,
                include_greedy: bool = False) -> list[dict[str, Any]]:
    """Each prompt row becomes the rows of its answers, each with its own id and `temperature`: the greedy
    answer keeps the row's id, sampled answer k is `<id>~s<k>`. More answers per prompt are the cheapest
    new data: the prompt's prefill is short next to the answer, and samples cover the branches the target
    takes at T > 0, which is where a draft meets them at T > 0."""
    if temperature == 0:
        return [{**r, "temperature": 0.0} for r in rows]
    out = []
    for r in rows:
        if include_greedy:
            out.append({**r, "temperature": 0.0})
        out.extend({**r, "id": f"{r['id']}~s{k}", "temperature": temperature} for k in range(samples))
    return out


def read_done(path: Path) -> set[str]:
    """Ids already written. A torn last line (killed mid-write) is dropped and the file rewritten."""
    if not path.exists():
        return set()
    good, done, torn = [], set(), False
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            done.add(str(rec["id"]))
            good.append(line)
        except (ValueError, KeyError, TypeError):
            torn = True
    if torn:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(g + "\n" for g in good))
        os.replace(tmp, path)
    return done


class Regenerator:
    def __init__(self, model, tok, batch_size: int = 32, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0):
        from tsengine.targets import eos_ids

        self.model, self.tok = model, tok
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.eos = eos_ids(model, tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]

    @torch.no_grad()
    def answer(self, histories: list[list[dict[str, str]]], key: str) -> list[tuple[str, bool] | None]:
        """One assistant reply per history: (text, finished with an end-of-turn token), or None for a
        history the chat template rejects."""
        from jinja2 import TemplateError

        tok, texts = self.tok, []
        for h in histories:
            try:
                texts.append(tok.apply_chat_template(h, tokenize=False, add_generation_prompt=True))
            except TemplateError:
                texts.append(None)
        ok = [i for i, t in enumerate(texts) if t is not None]
        if not ok:
            return [None] * len(histories)
        texts = [texts[i] for i in ok]
        side, tok.padding_side = tok.padding_side, "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        tok.padding_side = side
        sample = self.temperature > 0
        if sample:  # the draw depends on the batch's first id, not on what ran before: restarts reproduce
            torch.manual_seed(self.seed + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16))
        out = self.model.generate(
            **enc, max_new_tokens=self.max_new_tokens, do_sample=sample, pad_token_id=self.pad,
            eos_token_id=self.eos, **({"temperature": self.temperature, "top_p": self.top_p} if sample else {}),
        )
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        replies: list[tuple[str, bool] | None] = [None] * len(histories)
        for i, ids in zip(ok, new):
            stop = next((j for j, t in enumerate(ids) if t in self.eos), None)
            body = ids if stop is None else ids[:stop]
            replies[i] = (tok.decode(body, skip_special_tokens=True).strip(), stop is not None)
        return replies

    def run(self, rows: Iterable[dict[str, Any]], out_path: str | Path, progress: bool = True) -> Skipped:
        """Regenerate every row not yet in `out_path`; returns rows skipped by reason."""
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        done, skipped = read_done(out_path), Skipped()
        todo = [(rid, msgs) for rid, _, msgs in pending(rows, done, skipped)]
        todo.sort(key=lambda r: sum(len(m["content"]) for m in r[1]))  # similar lengths pad less
        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress)
        with out_path.open("a") as f:
            for b in range(0, len(todo), self.batch_size):
                batch = todo[b:b + self.batch_size]
                records = self._batch(batch, skipped)
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))
        bar.close()
        return skipped

    def _batch(self, batch: list[tuple[str, list[dict[str, str]]]], skipped: Skipped) -> list[dict[str, Any]]:
        """Turn by turn: round r answers the r-th assistant turn of every conversation that has one."""
        convs = [[m for m in msgs] for _, msgs in batch]
        turns = [reply_slots(c) for c in convs]
        finished = [True] * len(batch)
        ok, why = [True] * len(batch), [""] * len(batch)
        for r in range(max(len(t) for t in turns)):
            live = [j for j in range(len(batch)) if r < len(turns[j]) and ok[j]]
            if not live:
                break
            histories = [convs[j][:turns[j][r]] for j in live]
            for j, reply in zip(live, self.answer(histories, batch[live[0]][0] + f"/{r}")):
                if reply is None:
                    ok[j], why[j] = False, "rejected by the chat template"
                    continue
                text, fin = reply
                if not text:
                    ok[j], why[j] = False, "empty response"
                    continue
                reply = {"role": "assistant", "content": text}
                at = turns[j][r]
                convs[j] = convs[j][:at] + [reply] + convs[j][at + 1:]
                finished[j] = finished[j] and fin
        records = []
        for j, (rid, _) in enumerate(batch):
            if not ok[j]:
                skipped.add(why[j])
                continue
            records.append({"id": rid, "messages": convs[j], "finished": finished[j]})
        return records


def main(argv: list[str] | None = None) -> int:
    from tsengine.train.threads import use_machine_cores  # first: before torch's thread pool sizes itself
    use_machine_cores()
    p = argparse.ArgumentParser(prog="python -m tsengine.train.regenerate", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF directory, embedded name (smollm2-135m) or hub id")
    p.add_argument("--data", required=True, help="JSON/JSONL/Parquet rows (messages or conversations)")
    p.add_argument("--out", required=True, help="output JSONL (appended; finished ids are skipped)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int)
    p.add_argument("--backend", choices=("engine", "hf", "openai"), default="engine",
                   help="engine: tsengine (continuous batching); hf: transformers generate; openai: the servers "
                   "of --base-url")
    p.add_argument("--base-url", action="append", default=[], help="openai: a server's URL (repeat for more; "
                   "the key comes from $OPENAI_API_KEY)")
    p.add_argument("--model", help="openai: the served model name (default: the one the servers list)")
    args = p.parse_args(argv)

    def body() -> None:
        if args.batch_size < 1 or args.max_new_tokens < 1:
            raise UserError("--batch-size and --max-new-tokens must be >= 1")
        if args.temperature < 0 or not 0 < args.top_p <= 1:
            raise UserError("--temperature must be >= 0 and --top-p in (0, 1]")
        from tsengine.targets import load_target, resolve

        rows = [{**row, "temperature": args.temperature} for row in list(load_rows(args.data))[: args.max_samples]]
        if (args.backend == "openai") != bool(args.base_url):
            raise UserError("--base-url is needed with --backend openai, and only there")
        if args.backend == "openai":
            from tsengine.train.regen_openai import OpenAIRegenerator

            regen = OpenAIRegenerator(args.base_url, args.model, args.batch_size, args.max_new_tokens, args.top_p,
                                      args.seed)
        elif args.backend == "engine":
            from transformers import AutoTokenizer

            from tsengine.train.regen_engine import EngineRegenerator

            path = str(resolve(args.target))
            regen = EngineRegenerator(path, AutoTokenizer.from_pretrained(path), args.batch_size, args.max_new_tokens,
                                      args.top_p, args.seed)
        else:
            model, tok = load_target(args.target)
            regen = Regenerator(model, tok, args.batch_size, args.max_new_tokens, args.temperature, args.top_p,
                                args.seed)
        skipped = regen.run(rows, args.out)
        print(f"regenerate: {skipped.summary(len(read_done(Path(args.out))))} -> {args.out}")

    return run_main("regenerate", body)


if __name__ == "__main__":
    sys.exit(main())
