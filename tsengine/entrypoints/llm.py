"""The offline Python API, shaped like vLLM's: `LLM(model=..., speculative_config=...).generate(...)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from tsengine.config import EngineConfig, SpeculativeConfig
from tsengine.engine.core import Engine
from tsengine.entrypoints.fanout import fan_out
from tsengine.errors import UserError
from tsengine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or "error" (this sample alone failed: `error` says why)
    # tokens committed by each verify step, bonus included, cut at a stop (tsengine.infer.reference's accept_lengths):
    # kept per sample, not per request, because n > 1 samples verify independently
    spec_accept_lengths: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0


class LLM:
    def __init__(self, model: str, speculative_config: dict | str | None = None, **engine_args: Any):
        spec = engine_args.pop("speculative", None)
        if speculative_config is not None:
            if spec is not None:
                raise UserError("give speculative_config or speculative, not both")
            spec = SpeculativeConfig.resolve(config_json=speculative_config)
        self.engine = Engine(EngineConfig.make(model=model, speculative=spec, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise UserError("prompts: each must be a string, a list of token ids or {'prompt_token_ids': [...]}")

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        results, owner = [], {}
        for prompt, p in zip(prompts, params):
            text, ids = self.encode(prompt)
            rid = str(next(self._ids))
            res = RequestOutput(rid, text, ids, [CompletionOutput(i, "", [], None) for i in range(p.n)])
            results.append(res)
            for i, (sub_id, sub) in enumerate(fan_out(rid, p)):
                self.engine.add_request(sub_id, ids, sub)
                owner[sub_id] = (res, i)
        bar = tqdm(total=len(owner), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res, i = owner[out.request_id]
                res.outputs[i].token_ids.extend(out.new_tokens)
                res.spec_verify_steps += int(out.verify)
                res.spec_accepted_tokens += out.accepted
                if out.verify:
                    res.outputs[i].spec_accept_lengths.append(len(out.new_tokens))
                if out.finished:
                    res.outputs[i].finish_reason, res.outputs[i].error = out.finish_reason, out.error
                    bar.update(1)
        bar.close()
        for res in results:
            for o in res.outputs:
                o.text = self.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        return results

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **kw) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
        prompts = [{"prompt_token_ids": self.tokenizer(t, add_special_tokens=False)["input_ids"]} for t in texts]
        return self.generate(prompts, sampling_params, **kw)
