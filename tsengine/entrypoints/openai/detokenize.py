"""Token ids to text while they stream in, and where stop strings cut that text.

A token's text depends on its neighbours (merges, leading spaces, UTF-8 characters split across tokens),
so pieces are decoded in context rather than one by one. With stop strings the last (longest stop − 1)
characters are held back from the stream until they can no longer start a stop string, so a stream never
shows text the final answer cuts.
"""

from __future__ import annotations


class Detokenizer:
    """Decodes a growing token list piece by piece. A piece is decoded together with the tokens before it
    (so merges and leading spaces come out as in a full decode), and text ending in an incomplete UTF-8
    character ("\\ufffd") is held until the next token completes it, or until the end."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, new: list[int], final: bool = False) -> str:
        self.ids.extend(new)
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = dec(self.ids[self.prefix:self.read])
        now = dec(self.ids[self.prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""


class ChoiceText:
    """One choice: its text so far, where a stop string cut it, and how much of it was already sent."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok, self.stops = Detokenizer(tokenizer), stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent = "", 0
        self.finish_reason: str | None = None
        self.tokens = self.verify_steps = self.accepted = 0
        self.last_token_time: float | None = None

    def update(self, out) -> None:
        self.tokens += len(out.new_tokens)
        self.verify_steps += int(out.verify)
        self.accepted += out.accepted
        start = max(0, len(self.text) - self.hold)
        self.text += self.detok.push(out.new_tokens, final=out.finished)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.finish_reason = self.text[:min(hits)], "stop"
        elif out.finished:
            self.finish_reason = out.finish_reason

    def pending(self) -> str:
        """The text not yet sent that no stop string can still cut."""
        end = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta
