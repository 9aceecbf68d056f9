"""The OpenAI request bodies we accept, and the response shapes we send, for /v1/completions and chat.

Strict on purpose: an unknown field (`logprobs`, `presence_penalty`, a typo) is a 400 naming it rather
than a silently ignored knob, and a wrong type is not coerced ("0.5" is not a temperature). Ranges are
checked here too, so a bad value never reaches the engine thread. Fields that only vLLM has and that we
honour (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`) use vLLM's names. JSON null is the default for
every field OpenAI (or vLLM, for its own) marks nullable: the official client sends null when a caller
passes None.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tsengine.sampling_params import MAX_TOKEN_ID, MAX_TOP_K, SamplingParams

MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 16, 1000, 256
# nullable in OpenAI's API (vLLM's for top_k and min_p) and with a default other than None here: null is
# that default (the fields whose default is None take null as it is)
NULL_IS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "n", "stream")


def _valid_unicode(text: str) -> str:
    """JSON can spell a lone UTF-16 surrogate ("\\ud800"); Python keeps it in the str, no tokenizer or
    UTF-8 encoder accepts it. Refused here, so it is a 400 naming the field rather than a crash later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate {text[e.start]!r} at character {e.start}, "
                         "which is not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Every bound here is one the engine can represent (int64 seeds, int32-range top_k and ids), and the
    schema at /openapi.json shows each of them, so a client generating from it stays inside. The fields of
    NULL_IS_DEFAULT are typed `| None` for the schema's sake: after validation none of them is None."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(1.0, ge=0, le=1e6)  # below sampling.GREEDY_BELOW (1e-5): greedy
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # the engine keeps seeds in int64 tensors
    n: int | None = Field(1, ge=1, le=128)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, max_length=256)

    @field_validator(*NULL_IS_DEFAULT, mode="before")
    @classmethod
    def _null_is_default(cls, value, info: ValidationInfo):
        return cls.model_fields[info.field_name].default if value is None else value

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, prompt_len: int, max_model_len: int, default_max_tokens: int) -> SamplingParams:
        """The request's sampling, all `n` choices in one (`entrypoints/fanout.py` splits them as `LLM.generate` does);
        without max_tokens, the server's default, cut to what the context leaves."""
        max_tokens = min(self.requested_max_tokens or default_max_tokens, max_model_len - prompt_len)
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=max_tokens, seed=self.seed, n=self.n,
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(None, max_length=256)

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "\n".join(p.text for p in self.content)
        out = {"role": self.role, "content": content or ""}
        return {**out, "name": self.name} if self.name is not None else out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)  # the newer name for max_tokens

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ---------------------------------------------------------------------------------------------
class APIError(Exception):
    """A request the server refuses, carrying what OpenAI's error body says (see `error_body`)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers


def shutting_down() -> APIError:
    """The answer to a request the server will not serve because it is shutting down (shutdown.py): one
    that came after the signal, or one the drain's deadline found before the engine (tokenizing)."""
    return APIError(503, "the server is shutting down; retry on another replica", None, "service_unavailable",
                    "server_shutting_down", headers={"Retry-After": "5"})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every non-2xx answer of this server has it (documented per route)."""

    error: ErrorDetail


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, spec: tuple[int, int] | None) -> dict:
    """OpenAI's usage; with speculation also the verify steps (target forwards that verified drafts) and the
    accepted draft tokens, so a client can compute τ = 1 + spec_accepted_tokens / spec_verify_steps (tokens
    per verify forward; NGRAM and adaptive speculation also decode some steps plainly)."""
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
