"""Chat data -> token ids + an assistant-only loss mask, through the target tokenizer's own chat template.

Rows are read and normalized by tsengine.conversations (ShareGPT or OpenAI shape, JSON / JSONL / Parquet),
which evaluation shares.

The mask is derived from the rendered text, so any template works without per-model regexes: every
message's content is located in order in the full rendering (templates may trim it, and may re-render
earlier turns differently, as Qwen3 does with its think block, so a prefix diff would not do), and an
assistant span runs from its content to the end-of-turn token the template writes right after it (found
once per tokenizer by rendering a probe turn). Tokens whose characters fall in those spans are trained
on; everything else, template scaffolding included, is context.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from tsengine.conversations import normalize


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Skipped:
    """Rows left out, counted by reason; printed as one summary line."""

    reasons: Counter = field(default_factory=Counter)

    def add(self, reason: str) -> None:
        self.reasons[reason] += 1

    def summary(self, kept: int) -> str:
        if not self.reasons:
            return f"{kept} rows kept, none skipped"
        parts = ", ".join(f"{n} {r}" for r, n in self.reasons.most_common())
        return f"{kept} rows kept, {sum(self.reasons.values())} skipped ({parts})"


def render(tok, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


_PROBE = "tsengine-probe-7f3a"


def end_of_turn(tok) -> str:
    """The special token the template writes right after an assistant message ('' if none)."""
    cached = getattr(tok, "_tsengine_eot", None)
    if cached is not None:
        return cached
    full = render(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}])
    rest = full[full.index(_PROBE) + len(_PROBE):].lstrip(" ")
    specials = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
    eot = max((s for s in specials if s and rest.startswith(s)), key=len, default="")
    tok._tsengine_eot = eot
    return eot


def _skeleton(tok, messages: list[dict[str, str]]) -> list[str]:
    """The template's own text around each message: render with unique markers as contents and cut.
    Anchoring on these segments (not on searching for the content) makes a reply that repeats text
    the template writes ("assistant", a role header) impossible to mistake for it."""
    marks = [f"\u27e6tsengine-{i}\u27e7" for i in range(len(messages))]  # no whitespace: survives | trim
    sk = render(tok, [{**m, "content": mk} for m, mk in zip(messages, marks)])
    segs, pos = [], 0
    for mk in marks:
        j = sk.find(mk, pos)
        if j < 0:
            raise ValueError("template drops a turn's content")
        segs.append(sk[pos:j])
        pos = j + len(mk)
    return segs + [sk[pos:]]


def assistant_spans(tok, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the [start, end) character spans of every assistant turn."""
    full, eot = render(tok, messages), end_of_turn(tok)
    segs = _skeleton(tok, messages)
    spans, pos = [], 0
    for seg, m in zip(segs, messages):
        if not full.startswith(seg, pos):
            raise ValueError("template rewrites content")
        pos += len(seg)
        c = m["content"]
        text = next((x for x in (c, c.strip(), c.lstrip(), c.rstrip()) if full.startswith(x, pos)), None)
        if text is None:
            raise ValueError("template rewrites content")
        start, pos = pos, pos + len(text)
        if m["role"] == "assistant":
            rest = full[pos:]
            gap = len(rest) - len(rest.lstrip())  # content may end in a newline the template keeps
            end = pos + gap + len(eot) if eot and rest[gap:].startswith(eot) else pos
            spans.append((start, end))
    return full, spans


def span_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """A token is trained if it overlaps an assistant span (one that straddles the start, " Hello" after
    "Assistant:", is what the model emits)."""
    return [int(b > a and any(max(a, s) < min(b, e) for s, e in spans)) for a, b in offsets]


def tokenize(tok, messages: list[dict[str, str]], max_length: int | None = None) -> Example:
    full, spans = assistant_spans(tok, messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = span_mask(offsets, spans)
    if max_length is not None and len(ids) > max_length:
        raise ValueError("over max length")
    if not any(mask):
        raise ValueError("no assistant tokens")
    return Example(ids, mask)


def captured_example(tok, messages: list[dict[str, str]], prompt_ids: list[int], answer_ids: list[int],
                     max_length: int | None = None) -> Example:
    """The training example of a conversation whose last reply the engine generated: the token ids are
    exactly the ones the target ran (`prompt_ids`, its rendered generation prompt, then `answer_ids`,
    the sampled tokens up to and including the stop token), never a re-tokenization of the decoded text,
    which can differ from what was sampled and would pair features with the wrong tokens.

    The loss mask still comes from the chat template: the prompt's tokens are masked by the character
    spans of `tokenize` (earlier assistant turns are trained on), and the answer's tokens are all trained
    on — which is right only if the template writes the reply exactly as it was decoded, followed by its
    end-of-turn token. That is checked, and a row where it does not hold (a template that trims or
    rewrites the reply, a stop token that is not the template's end of turn) raises ValueError: counted
    and skipped, never trained on with a shifted mask."""
    full, spans = assistant_spans(tok, messages)
    prompt_text = render(tok, messages[:-1], add_generation_prompt=True)
    if not full.startswith(prompt_text):
        raise ValueError("template does not extend the generation prompt")
    enc = tok(prompt_text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != list(prompt_ids):
        raise ValueError("prompt ids differ from the rendered prompt")
    answer = tok.decode(answer_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not full.startswith(answer, len(prompt_text)):
        raise ValueError("captured answer differs from the template's rendering")
    ids = list(prompt_ids) + list(answer_ids)
    if max_length is not None and len(ids) > max_length:
        raise ValueError("over max length")
    return Example(ids, span_mask(enc["offset_mapping"], spans) + [1] * len(answer_ids))


def build(tok, rows: Iterable[dict[str, Any]], max_length: int | None = None) -> tuple[list[Example], Skipped]:
    """Tokenize every well-formed row; malformed ones are counted by reason and left out."""
    from jinja2 import TemplateError

    kept, skipped = [], Skipped()
    for row in rows:
        try:
            kept.append(tokenize(tok, normalize(row), max_length))
        except ValueError as e:
            skipped.add(str(e))
        except TemplateError:  # e.g. raise_exception('roles must alternate') in the model's template
            skipped.add("rejected by the chat template")
    return kept, skipped
