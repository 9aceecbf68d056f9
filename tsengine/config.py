"""Engine and speculation settings: strict (an unknown key is an error naming it), validated at startup.

Speculation is named as SGLang/TokenSpeed name it on the command line (`--speculative-algorithm EAGLE3`,
`--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`) and as vLLM
names it in `--speculative-config` JSON (`method`, `model`, `num_speculative_tokens`); both forms meet
in `SpeculativeConfig.resolve`, where a conflict between them is an error rather than a silent choice.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tsengine.errors import UserError, fail_if

# How the engine may store the EAGLE3 head's weights (tsengine/model/linear.py runs them; one list for every flag)
DraftQuantization = Literal["none", "bf16", "int8"]

ALGORITHMS = ("EAGLE3", "NGRAM")

# The shapes the engine runs (docs/design/tree-speculation.md): steps S, top-k K, nodes N (root included);
# N <= 64 because a window's ancestor set is one int64 bitmask.
NUM_STEPS, EAGLE_TOPK, NUM_DRAFT_TOKENS = (1, 10), (1, 16), (2, 64)
SHAPE_NAMES = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def tree_shape_problems(num_steps: int, topk: int, num_draft_tokens: int | None, *,
                        names: tuple[str, str, str] = SHAPE_NAMES, engine_limits: bool = True,
                        draft_vocab_size: int | None = None) -> list[str]:
    """Every violation of the draft tree shape rules, worded with `names` (the caller's own spelling of S,
    K and N). The rules: a chain verifies the root plus every draft (N = S+1); a tree needs its node
    budget N given; it cannot keep more nodes than S steps of top-K make (1 + K + (S-1)·K²); K cannot
    exceed the draft vocab. The engine adds `engine_limits`: its draft lanes, (S-1)·K frontier nodes, live
    in the N slots the target verifies next, and S, K, N stay within NUM_STEPS, EAGLE_TOPK and
    NUM_DRAFT_TOKENS. The reference generator (tsengine.infer.reference) checks the rules without them:
    it recomputes everything, so any tree a drafter can grow is one it can verify."""
    (S, K, N), (s, k, n) = names, (num_steps, topk, num_draft_tokens)

    def outside(name: str, v: int, bounds: tuple[int, int]) -> str | None:
        lo, hi = bounds
        if v < lo or engine_limits and v > hi:
            return f"{name} is {v}; " + (f"allowed: {lo}..{hi}" if engine_limits else f"must be >= {lo}")
        return None

    problems = [p for p in (outside(S, s, NUM_STEPS), outside(K, k, EAGLE_TOPK)) if p]
    if n is None and k > 1:
        problems.append(f"{N} must be given for a tree ({K} > 1): the number of nodes verified, root included")
    if n is not None:
        if p := outside(N, n, NUM_DRAFT_TOKENS):
            problems.append(p + " (nodes including the root)")
        if k == 1 and n != s + 1:
            problems.append(f"{N} is {n}; a chain ({K} 1) needs {N} = {S} + 1 = {s + 1}: the target verifies the "
                            f"root plus every draft, so their count must equal {S} + 1 = {s + 1}")
        if engine_limits and k > 1 and (s - 1) * k > n:
            problems.append(f"({S} - 1) * {K} = {(s - 1) * k} draft lanes exceed {N} {n}: the frontier nodes "
                            "are drafted in the slots the target verifies next")
        if k > 1 and n > 1 + k + (s - 1) * k * k:
            problems.append(f"{N} {n} exceeds what {s} steps of top-{k} can draft: "
                            f"1 + K + (S-1)*K^2 = {1 + k + (s - 1) * k * k}")
    if draft_vocab_size is not None and k > draft_vocab_size:
        problems.append(f"{K} {k} exceeds the head's draft vocab size {draft_vocab_size}")
    return problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeConfig(_Strict):
    # Ranges of the shape are checked in `checked`, so that one error lists every violation.
    algorithm: Literal["EAGLE3", "NGRAM"] = Field(
        "EAGLE3", description="EAGLE3 (a trained head) or NGRAM (prompt lookup in the request's own tokens)")
    draft_model_path: str | None = Field(None, description="EAGLE-3 head directory (export format)")
    num_steps: int = Field(3, description="draft forwards per step ({}..{})".format(*NUM_STEPS))
    eagle_topk: int = Field(1, description="children per expansion: 1 = chain, > 1 = tree ({}..{})".format(
        *EAGLE_TOPK))
    num_draft_tokens: int | None = Field(None, description="nodes verified per step, root included ({}..{}); a "
                                         "chain: steps + 1; required for a tree".format(*NUM_DRAFT_TOKENS))
    prompt_lookup_min: int = Field(1, ge=1, description="NGRAM: shortest suffix n-gram to look up")
    prompt_lookup_max: int = Field(4, ge=1, description="NGRAM: longest suffix n-gram to look up")
    # The verification rule at temperature > 0 (greedy rows always take exact matching).
    speculative_sampling: bool = Field(False, description=(
        "temperature > 0: rejection sampling against the draft's q (chain, EAGLE3); the default keyed Gumbel "
        "rule returns exactly plain sampling's tokens instead"))
    tree_sampling: Literal["gumbel", "multiround"] = Field("gumbel", description=(
        "temperature > 0 rule for trees: gumbel (default: plain sampling's tokens) or multiround (point-mass "
        "multi-round rejection)"))
    draft_model_quantization: DraftQuantization = Field("none", description=(
        "EAGLE3 head weights: none (as loaded), bf16 (rounded to bfloat16, fp32 math: half the bytes each "
        "draft step reads) or int8 (per-row symmetric: a quarter); bf16 and int8 are CPU fp32 only; drafts "
        "may differ, outputs cannot"))
    # None: on for EAGLE3 (`checked`), so that speculation costs little by default (issue 43): a fixed chain of 3
    # ran at 0.62-0.78x plain decoding at 16-64 requests (docs/benchmarks.md). The shape flags bound its choices.
    adaptive: bool | None = Field(None, description=(
        "choose every step among plain decoding, EAGLE3 chains of 1..num_steps (per request: head, prompt "
        "lookup or none) and the configured tree, from the measured acceptance and step cost "
        "(tsengine/speculative/adaptive/policy.py); default: on for EAGLE3 under the default sampling rule "
        "(off under rejection or multiround sampling, whose seeded tokens depend on the drafts); off pins the "
        "configured shape"))

    @property
    def rule(self) -> str:
        """The verification rule at temperature > 0: gumbel, rejection or multiround."""
        return "rejection" if self.speculative_sampling else ("multiround" if self.tree_sampling == "multiround"
                                                              else "gumbel")

    @property
    def is_tree(self) -> bool:
        return self.eagle_topk > 1

    def checked(self) -> "SpeculativeConfig":
        """Every violation at once: the tree shape (`tree_shape_problems`), the draft model, the n-gram sizes."""
        n, s = self.num_draft_tokens, self.num_steps
        problems = tree_shape_problems(s, self.eagle_topk, n)
        if self.algorithm == "EAGLE3" and not self.draft_model_path:
            problems.append("speculative decoding with EAGLE3 needs a draft model: --speculative-draft-model-path "
                            "DIR (or \"model\" in --speculative-config)")
        if self.algorithm == "NGRAM" and self.draft_model_path:
            problems.append("speculative_draft_model_path is set but NGRAM uses no draft model")
        if self.draft_model_quantization != "none" and self.algorithm != "EAGLE3":
            problems.append(f"speculative_draft_model_quantization {self.draft_model_quantization} quantizes an EAGLE3 "
                            f"head; {self.algorithm} has none")
        if self.adaptive and self.algorithm != "EAGLE3":
            problems.append("adaptive speculation chooses among plain decoding, prompt lookup and the EAGLE3 head's "
                            "chains and trees: it needs --speculative-algorithm EAGLE3 and a draft model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            problems.append(f"prompt_lookup_min {self.prompt_lookup_min} > prompt_lookup_max {self.prompt_lookup_max}")
        fail_if(problems, "invalid speculative decoding settings")
        update = {"num_draft_tokens": s + 1} if n is None else {}
        if self.adaptive is None:  # not by default under a rule whose tokens depend on the drafts: the policy
            # chooses by measured time, so the drafts, and a seeded request's tokens, would differ run to run
            update["adaptive"] = self.algorithm == "EAGLE3" and self.rule == "gumbel"
        return self.model_copy(update=update) if update else self

    @staticmethod
    def resolve(algorithm: str | None = None, draft_model_path: str | None = None, num_steps: int | None = None,
                eagle_topk: int | None = None, num_draft_tokens: int | None = None,
                config_json: str | dict | None = None, speculative_sampling: bool | None = None,
                tree_sampling: str | None = None, adaptive: bool | None = None,
                draft_model_quantization: str | None = None) -> "SpeculativeConfig | None":
        """Merge the flags and the JSON form; None when no speculation is asked for (the sampling-rule flags
        alone do not ask for it)."""
        flags = {"algorithm": algorithm, "draft_model_path": draft_model_path, "num_steps": num_steps,
                 "eagle_topk": eagle_topk, "num_draft_tokens": num_draft_tokens}
        flags = {k: v for k, v in flags.items() if v is not None}
        rules = {"speculative_sampling": speculative_sampling, "tree_sampling": tree_sampling, "adaptive": adaptive,
                 "draft_model_quantization": draft_model_quantization}
        rules = {k: v for k, v in rules.items() if v is not None}
        # the defaults ask for nothing, nor does pinning the shape (adaptive False)
        asked = {k for k, v in rules.items() if v not in (False, "gumbel", "none")}
        merged = dict(flags)
        if config_json is not None:
            if isinstance(config_json, str):
                try:
                    config_json = json.loads(config_json)
                except json.JSONDecodeError as e:
                    raise UserError(f"--speculative-config is not valid JSON: {e}") from None
            if not isinstance(config_json, dict):
                raise UserError("--speculative-config must be a JSON object")
            names = {"method": "algorithm", "model": "draft_model_path", "num_speculative_tokens": "num_steps",
                     "num_steps": "num_steps", "eagle_topk": "eagle_topk", "topk": "eagle_topk",
                     "num_draft_tokens": "num_draft_tokens", "prompt_lookup_min": "prompt_lookup_min",
                     "prompt_lookup_max": "prompt_lookup_max", "enable_speculative_sampling": "speculative_sampling",
                     "speculative_sampling": "speculative_sampling", "tree_sampling": "tree_sampling",
                     "adaptive": "adaptive", "quantization": "draft_model_quantization",
                     "draft_model_quantization": "draft_model_quantization"}
            problems = []
            for key, value in config_json.items():
                if key not in names:
                    problems.append(f"speculative_config key {key!r} is unknown; allowed: {', '.join(names)}")
                    continue
                field = names[key]
                if field == "algorithm" and isinstance(value, str) and value.lower() == "auto":  # EAGLE3, adaptive
                    value, merged["adaptive"] = "EAGLE3", True
                if field == "algorithm" and isinstance(value, str):
                    value = {"eagle3": "EAGLE3", "eagle-3": "EAGLE3", "ngram": "NGRAM"}.get(value.lower(), value)
                given = {**flags, **rules}
                if field in given and given[field] != value:
                    problems.append(f"speculative_config {key}={value!r} conflicts with the flag for {field} "
                                    f"({given[field]!r}); give it once")
                merged[field] = value
            fail_if(problems, "invalid --speculative-config")
        if not merged:
            if asked:
                raise UserError(f"{', '.join(sorted(asked))} set without speculative decoding: give "
                                "--speculative-algorithm (or --speculative-config) too")
            return None
        merged = {**rules, **merged}
        if merged.get("algorithm", "EAGLE3") not in ALGORITHMS:
            raise UserError(f"speculative algorithm {merged['algorithm']!r} is not supported; allowed: "
                            f"{', '.join(ALGORITHMS)}")
        try:
            return SpeculativeConfig(**merged).checked()
        except ValidationError as e:
            raise UserError("invalid speculative decoding settings:\n" + _describe(e)) from None


class EngineConfig(_Strict):
    """The descriptions are the command line's help too (tsengine/entrypoints/engine_args.py derives the flags)."""

    model: str = Field(description="target: HF directory, embedded name (smollm2-135m) or hub id")
    tokenizer: str | None = Field(None, description="tokenizer directory (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory: int | None = Field(None, ge=1, description="KV cache bytes (CPU), zero-filled at start; "
                                        "default: every --max-num-seqs request at --max-model-len, at most 4 GiB")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="overrides the memory budget (tests, "
                                      "reproducible benchmarks)")
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    seed: int = 0
    debug_checks: bool = Field(False, description="run the block/scheduler invariants every step")
    enforce_eager: bool = Field(False, description=(
        "run every step eagerly: no compiled step graphs (tsengine/model/graphs.py; also TSENGINE_ENFORCE_EAGER=1)"))
    enable_prefix_caching: bool = Field(True, description=(
        "reuse the KV blocks of prompt prefixes already computed, in the target's and the draft's cache "
        "(tsengine/cache/prefix_cache.py); --no-enable-prefix-caching turns it off"))
    capture_layer_ids: tuple[int, ...] | None = Field(None, description=(
        "the target layers whose outputs capturing requests keep (training data at engine speed: "
        "tsengine/engine/capture.py)"))
    speculative: SpeculativeConfig | None = None

    @staticmethod
    def make(**kw) -> "EngineConfig":
        try:
            return EngineConfig(**kw)
        except ValidationError as e:
            raise UserError("invalid engine settings:\n" + _describe(e)) from None


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"]) or "settings"
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {field}: unknown setting")
        else:
            lines.append(f"  - {field}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)
