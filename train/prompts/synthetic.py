"""Extra training prompts written by the target itself (recipe `data.synthetic_prompts: N`).

    python -m tsengine.train.prompts.synthetic --target smollm2-135m --n 40 --out FILE [--seed S]

The built-in collection is templated, so its phrasing repeats; a head trained only on it sees few ways of
asking. The target can vary that phrasing cheaply: shown a few built-in prompts of one category as earlier
turns of a chat (the form a small instruct model imitates best), it writes one more. A 135M model writes
plenty of junk too (answers, refusals, loops, copies of its examples), so every text goes through cheap
filters and a dedup against the built-ins, and attempts are oversampled to still reach N.

Reproducible by construction: attempt k has its own category (round-robin), its own examples and its own
sampling seed, all keyed by (recipe seed, k), and the engine's keyed sampling draws the same tokens alone
or batched. So the same seed and N give the same ids (`syn-<category>-<k>`) and texts, and the result is
cached under the run directory, keyed by target, seed, N and `VERSION`. Synthetic rows only ever join the
train split: validation stays the fixed built-in set, so τ stays comparable across recipes.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import math
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

from tsengine.errors import UserError, run_main
from tsengine.train.prompts import CATEGORIES, builtin_prompts, split

VERSION = 2  # bump whenever the instruction or a filter changes: cached results are keyed by it
SHOTS = 4
TEMPERATURE, TOP_P = 0.9, 0.95
OVERSAMPLE = 1.5
MAX_ROUNDS = 3
MAX_TOKENS = {"summarization": 200}  # a passage to summarize is long; everything else is a sentence or two
DEFAULT_MAX_TOKENS = 96

# How the instruction names each category; plain words, because a 135M model copies the wording it sees.
KIND = {"coding": "programming", "math": "math", "writing": "writing", "explanation": "explain-a-concept",
        "advice": "advice", "reasoning": "logic puzzle", "summarization": "summarize-this-text",
        "chat": "casual chat"}
SYSTEM = "You write realistic messages that a user might send to an AI assistant. Reply with the message only."
FIRST_ASK = "Write a new {kind} request."
NEXT_ASK = "Another one, on a different topic."

MIN_CHARS, MIN_WORDS, MAX_CHARS = 12, 3, 1000  # the built-ins span 12..595 characters, 3+ words
MIN_LETTERS = 0.4  # ASCII letters among non-space characters; the most numeric built-in is at 0.49

_TEMPLATE = re.compile(r"<\||\|>|<s>|</s>|\[/?INST\]|^(system|user|assistant)\s*$|<<SYS>>", re.I | re.M)
_REFUSAL = re.compile(r"\b(i'?m sorry|i am sorry|i cannot|i can'?t (help|assist|provide)|as an ai|i'?m an ai|"
                      r"i am an ai|i'?m not an ai|language model|i'?m not able to|i am not able to)\b", re.I)
_ANSWER_START = re.compile(r"^(sure|certainly|of course|absolutely|great question|"
                           r"(here is|here's|here are)(?! (a|an|the|my|some|this) (short )?(passage|text|paragraph|"
                           r"article|note|email|story|code|snippet|"
                           r"function|essay|list|report|review|message))|"
                           r"hello[!,.]? how can i|hi[!,.]? how can i|how can i (help|assist)|"
                           r"what can i do for you|i'?d be happy|i would be happy|thank you for|you're welcome)\b",
                           re.I)
_ANSWER_ANY = re.compile(r"\b(i hope this helps|let me know if|you'?re welcome|how can i assist|"
                         r"feel free to ask|in conclusion)\b", re.I)
_ECHO = re.compile(r"\b(another one|different topic|new (\w+[- ])*request|reply with the message|"
                   r"realistic messages?|example \d)\b", re.I)
_LABEL = re.compile(r"^\s*((new |another )?(request|message|prompt|question|user|example)( \d+)?\s*:|\d+[.)])\s*",
                    re.I)
# A request asks (a question mark) or tells (an imperative, a first-person need, a task framing).
_REQUEST_WORDS = set("""write explain describe give tell list summarize summarise create make suggest help compose
draft generate translate find calculate compute solve show recommend compare rewrite plan design fix implement
convert outline name teach walk break turn sell invent imagine pretend please can could would will what how why
who when where which is are do does did should i i'm i've i'd my we let's text task quick homework be rate pick
simplify estimate check review edit correct shorten expand brainstorm come share introduce define predict start
begin round tl tldr continue finish complete identify classify sort choose decide evaluate proofread paraphrase
condense answer guess say try use keep think consider assume suppose given thanks thank hi hello hey good""".split())
_SENTENCE_START = re.compile(r"(?:^|[.!?:,;]\s+|\n)\s*[\"'(]?([A-Za-z']+)")  # clauses too: "Given X, write"


def dedup_key(text: str) -> str:
    """Case, punctuation and spacing ignored: "What is DNS?" and "what is dns" are one prompt."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def clean(text: str) -> str:
    """Strip what a model wraps a message in (labels, numbering, quotes) so filters judge the message."""
    text = text.strip()
    for _ in range(2):
        text = _LABEL.sub("", text).strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'`":
            text = text[1:-1].strip()
    return text


def _repetitive(text: str) -> bool:
    """Loops in the prose; code is left out (a buggy snippet legitimately repeats its names)."""
    text = re.sub(r"```.*?(```|$)", " ", text, flags=re.S)
    words = re.findall(r"\w+", text.lower())
    # Long runs only: "X is heavier than Y" three times is a puzzle, not a loop, and a passage may name
    # its subject ("ten minutes of daily stretching") a few times; a loop repeats whole clauses.
    runs = Counter(tuple(words[i:i + 6]) for i in range(len(words) - 5))
    if runs and max(runs.values()) >= 3:
        return True
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    if len(grams) >= 16 and len(set(grams)) / len(grams) < 0.7:
        return True
    sentences = [dedup_key(s) for s in re.split(r"(?<=[.!?])\s+|\n+", text) if len(s.split()) >= 4]
    return len(sentences) != len(set(sentences)) or re.search(r"(.)\1{7,}", text) is not None


def _looks_like_request(text: str) -> bool:
    if "?" in text:
        return True
    return any(w.lower() in _REQUEST_WORDS for w in _SENTENCE_START.findall(text))


def reject_reason(text: str, shots: list[str] = (), truncated: bool = False) -> str | None:
    """Why `text` is not a usable user request, or None. Cheap checks only: the point is to drop the
    obvious junk a small model writes, not to judge quality, and every built-in prompt must pass."""
    if not text.strip():
        return "empty"
    if truncated:
        return "truncated"
    if _TEMPLATE.search(text):
        return "template"
    visible = re.sub(r"\s", "", text)
    if sum(c.isascii() and c.isalpha() for c in visible) < MIN_LETTERS * len(visible):
        return "non_letters"  # symbols, digits, or another script (the built-ins are all English)
    if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
        return "too_short"
    if len(text) > MAX_CHARS:
        return "too_long"
    if _repetitive(text):
        return "repetitive"
    if _REFUSAL.search(text):
        return "refusal"
    if _ANSWER_START.search(text) or _ANSWER_ANY.search(text):
        return "answer"
    if _ECHO.search(text):
        return "echo_instruction"
    key = dedup_key(text)
    for shot in shots:
        other = dedup_key(shot)
        if key in other or other in key or difflib.SequenceMatcher(None, key, other).ratio() >= 0.8:
            return "echo_seed"
    if not _looks_like_request(text):
        return "not_a_request"
    return None


class NearDups:
    """Word 5-gram overlap through an inverted index: a memorised puzzle ("A snail is at the bottom of a
    20-foot well...") comes back with small edits that exact dedup misses, and pairwise diffs are O(N²)."""

    def __init__(self, share: float = 0.5):
        self.share, self.index, self.sizes = share, {}, []

    @staticmethod
    def grams(text: str) -> set:
        words = dedup_key(text).split()
        return {tuple(words[i:i + 5]) for i in range(len(words) - 4)}

    def seen(self, text: str) -> bool:
        grams = self.grams(text)
        hits = Counter(j for g in grams for j in self.index.get(g, ()))
        return any(c >= self.share * min(len(grams), self.sizes[j]) for j, c in hits.items())

    def add(self, text: str) -> None:
        grams = self.grams(text)
        for g in grams:
            self.index.setdefault(g, []).append(len(self.sizes))
        self.sizes.append(len(grams))


def _keyed(seed: int, k: int) -> int:
    digest = hashlib.sha256(f"synthetic:{seed}:{k}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**62


def attempt(seed: int, k: int, pool: dict[str, list[str]]) -> tuple[str, list[str], int]:
    """(category, example prompts, sampling seed) of attempt k: a pure function of (seed, k), so adding
    attempts (a larger N) never changes the earlier ones."""
    cat = CATEGORIES[k % len(CATEGORIES)]
    shots = random.Random(_keyed(seed, k)).sample(pool[cat], min(SHOTS, len(pool[cat])))
    return cat, shots, _keyed(seed + 1, k)


def conversation(cat: str, shots: list[str]) -> list[dict]:
    """Examples as the assistant's earlier turns: a tiny model continues a pattern far better than it
    follows a described task (a numbered list of examples in one message gets answered, not extended)."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, shot in enumerate(shots):
        msgs.append({"role": "user", "content": FIRST_ASK.format(kind=KIND[cat]) if i == 0 else NEXT_ASK})
        msgs.append({"role": "assistant", "content": shot})
    msgs.append({"role": "user", "content": NEXT_ASK if shots else FIRST_ASK.format(kind=KIND[cat])})
    return msgs


def generate(target: str, seed: int, n: int, llm=None, log=print,
             rejected: list | None = None) -> tuple[list[dict], dict]:
    """N filtered, deduplicated prompts spread over the categories, and a report (kept, dropped by
    reason, attempts, wall time, tokens/s). One batched engine call per round; a further round only when
    filtering left fewer than N. `rejected` collects the dropped texts, for tuning the filters."""
    from tsengine.sampling_params import SamplingParams

    builtins = builtin_prompts()
    pool: dict[str, list[str]] = {}
    for row in split(builtins)[0]:  # examples from the train split only, so no validation text is shown
        pool.setdefault(row["category"], []).append(row["messages"][0]["content"])
    seen = {dedup_key(row["messages"][0]["content"]) for row in builtins}
    near = NearDups()
    for row in builtins:
        near.add(row["messages"][0]["content"])
    if llm is None:
        from tsengine.entrypoints.llm import LLM

        llm = LLM(target, seed=seed)
    tok = llm.tokenizer
    context = getattr(getattr(llm, "engine", None), "max_model_len", None) or 1 << 30
    kept: dict[str, list[dict]] = {c: [] for c in CATEGORIES}
    dropped: Counter = Counter()
    wall, gen_tokens, done = 0.0, 0, 0
    for _ in range(MAX_ROUNDS):
        have = sum(map(len, kept.values()))
        if have >= n:
            break
        rate = have / done if done else 1.0
        count = min(math.ceil((n - have) * OVERSAMPLE / max(rate, 0.1)), 4 * n + 8)
        jobs = [(k, *attempt(seed, k, pool)) for k in range(done, done + count)]
        prompts, params, fits = [], [], []
        for job in jobs:
            cat, shots, s = job[1:]
            text = tok.apply_chat_template(conversation(cat, shots), tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            limit = MAX_TOKENS.get(cat, DEFAULT_MAX_TOKENS)
            if len(ids) + limit > context:  # a short-context target: the examples alone fill the window
                dropped["context"] += 1
                continue
            fits.append(job)
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=s, max_tokens=limit))
        t0 = time.time()
        outs = llm.generate(prompts, params) if prompts else []
        wall += time.time() - t0
        for (k, cat, shots, _s), res in zip(fits, outs):
            out = res.outputs[0]
            gen_tokens += len(out.token_ids)
            text = clean(out.text)
            why = reject_reason(text, shots, truncated=out.finish_reason == "length")
            if why is None and dedup_key(text) in seen:
                why = "duplicate"
            if why is None and near.seen(text):
                why = "near_duplicate"
            if why:
                dropped[why] += 1
                if rejected is not None:
                    rejected.append({"id": f"syn-{cat}-{k:05d}", "reason": why, "text": out.text})
                continue
            seen.add(dedup_key(text))
            near.add(text)
            kept[cat].append({"id": f"syn-{cat}-{k:05d}", "category": cat,
                              "messages": [{"role": "user", "content": text}]})
        done += count
    # Round-robin over categories, so a category the model writes well cannot crowd out the others.
    chosen, i = [], 0
    while len(chosen) < n and any(i < len(v) for v in kept.values()):
        chosen.extend(kept[c][i] for c in CATEGORIES if i < len(kept[c]) and len(chosen) < n)
        i += 1
    chosen.sort(key=lambda row: int(row["id"].rsplit("-", 1)[1]))
    passed = sum(map(len, kept.values()))
    report = {"requested": n, "attempts": done, "passed": passed, "kept": len(chosen),
              "surplus": passed - len(chosen), "dropped": dict(dropped.most_common()),
              "kept_rate": round(passed / done, 3) if done else None, "wall_s": round(wall, 1),
              "generated_tokens": gen_tokens, "tokens_per_s": round(gen_tokens / wall, 1) if wall else None,
              "per_category": dict(Counter(row["category"] for row in chosen))}
    if len(chosen) < n:
        log(f"synthetic prompts: only {len(chosen)} of {n} passed the filters after {done} attempts")
    return chosen, report


def require_builtin(r) -> None:
    """Synthetic prompts are seeded from the built-in categories; other data has none to imitate."""
    if r.data.synthetic_prompts and r.data.source != "builtin":
        raise UserError(f"data.synthetic_prompts={r.data.synthetic_prompts} needs data.source builtin "
                        f"(got {r.data.source!r}); set data.synthetic_prompts=0")


def add_synthetic(rows: list[dict], r, root: Path, llm=None, log=print) -> list[dict]:
    """The train rows plus `r.data.synthetic_prompts` target-written ones, cached in
    DIR/data/prompts/synthetic.jsonl; a sidecar holds the settings it was made with, so a changed target,
    seed, N or generator version regenerates it and anything else reuses it."""
    require_builtin(r)
    n = r.data.synthetic_prompts
    if not n:
        return rows
    out = Path(root) / "data" / "prompts" / "synthetic.jsonl"
    side, rep = out.with_suffix(".settings.json"), out.with_suffix(".report.json")
    settings = {"target": r.target, "seed": r.seed, "n": n, "version": VERSION}
    if out.exists() and side.exists() and json.loads(side.read_text()) == settings:
        syn = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        log(f"synthetic prompts: {len(syn)} reused from {out}")
    else:
        syn, report = generate(r.target, r.seed, n, llm=llm, log=log)
        out.parent.mkdir(parents=True, exist_ok=True)
        side.unlink(missing_ok=True)  # written last: a crash in between leaves no valid-looking cache
        out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in syn))
        rep.write_text(json.dumps(report, indent=1))
        side.write_text(json.dumps(settings))
        log(f"synthetic prompts: {report['kept']} kept of {report['attempts']} attempts, dropped "
            f"{report['dropped']}, {report['wall_s']} s, {report['tokens_per_s']} tok/s")
    have = {dedup_key(x["messages"][0]["content"]) for x in rows}
    return rows + [x for x in syn if dedup_key(x["messages"][0]["content"]) not in have]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tsengine.train.prompts.synthetic", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="model directory or embedded name (smollm2-135m)")
    ap.add_argument("--n", type=int, required=True, help="prompts wanted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSONL to write (.report.json and .rejected.jsonl land next to it)")
    args = ap.parse_args(argv)

    def body() -> None:
        if args.n < 1:
            raise UserError(f"--n {args.n}: must be at least 1")
        rejected: list = []
        rows, report = generate(args.target, args.seed, args.n, rejected=rejected)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows))
        out.with_suffix(".rejected.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n"
                                                              for x in rejected))
        out.with_suffix(".report.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))

    return run_main("tsengine.train.prompts.synthetic", body)


if __name__ == "__main__":
    sys.exit(main())
