"""The OpenAI request bodies we accept, and the response shapes we send, for /v1/completions and chat.

Strict on purpose: an unknown field (`logprobs`, `presence_penalty`, a typo) is a 400 naming it rather
than a silently ignored knob, and a wrong type is not coerced ("0.5" is not a temperature). Ranges are
checked here too, so a bad value never reaches the engine thread. Fields that only vLLM has and that we
honour (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`) use vLLM's names.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tsengine.sampling import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # the engine keeps seeds in int64 tensors
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v):
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("an empty stop string would match before the first token")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The request's sampling, all `n` choices in one (tsengine.fanout splits them as `LLM.generate` does);
        without max_tokens, up to the end of the context."""
        max_tokens = self.requested_max_tokens or max_model_len - prompt_len
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=max_tokens, seed=self.seed, n=self.n,
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "\n".join(p.text for p in self.content)
        out = {"role": self.role, "content": content or ""}
        return {**out, "name": self.name} if self.name is not None else out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name for max_tokens

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ---------------------------------------------------------------------------------------------
class APIError(Exception):
    """A request the server refuses, carrying what OpenAI's error body says (see `error_body`)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, spec: tuple[int, int] | None) -> dict:
    """OpenAI's usage; with speculation also the verify steps (target forwards that decoded) and the
    accepted draft tokens, so a client can compute τ = completion_tokens / spec_verify_steps."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if spec is not None:
        out["spec_verify_steps"], out["spec_accepted_tokens"] = spec
    return out


def completion(rid: str, model: str, chat: bool, texts: list[str], reasons: list[str | None],
               use: dict) -> dict:
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use}


def chunk(rid: str, model: str, chat: bool, created: int, choices: list[dict], with_usage: bool,
          use: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": choices}
    if with_usage:
        out["usage"] = use
    return out


def chunk_choice(chat: bool, index: int, text: str, finish_reason: str | None, role: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
