"""Command-line flags for the engine, shared by `tsengine generate`, `serve` and `bench`.

Each flag is an `EngineConfig` or `SpeculativeConfig` field: its type, choices, bounds, default and help
are read from the field (tsengine/config.py), so a setting is described once and the command line cannot
drift from what the engine accepts. Speculation flags carry SGLang/TokenSpeed names; `--speculative-config`
takes vLLM's JSON form. Both go through `SpeculativeConfig.resolve`, so a conflict between them is one
clear error.
"""

from __future__ import annotations

import argparse
import types
from typing import Literal, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo

from tsengine.config import EngineConfig, SpeculativeConfig

# Engine settings set in code only: the KV block count (tests, reproducible benchmarks), the capture layers
# (the capture API) and the speculation object, which the "speculative decoding" group below builds.
NOT_FLAGS = ("num_kv_blocks", "capture_layer_ids", "speculative")
# SpeculativeConfig fields on the command line, under SGLang's names (the n-gram sizes are JSON-only).
SPECULATIVE_FLAGS = {"algorithm": "--speculative-algorithm", "draft_model_path": "--speculative-draft-model-path",
                     "num_steps": "--speculative-num-steps", "eagle_topk": "--speculative-eagle-topk",
                     "num_draft_tokens": "--speculative-num-draft-tokens",
                     "speculative_sampling": "--enable-speculative-sampling", "tree_sampling": "--spec-tree-sampling",
                     "adaptive": "--speculative-adaptive",
                     "draft_model_quantization": "--speculative-draft-model-quantization"}


def _engine_flags() -> dict[str, str]:
    return {name: "--" + name.replace("_", "-") for name in EngineConfig.model_fields if name not in NOT_FLAGS}


def _kind(annotation) -> tuple[type, tuple | None]:
    """(the value's type, its allowed values) from an annotation: `X | None` is X, Literal gives choices."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = (a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        return type(choices[0]), choices
    return annotation, None


def _bounded(kind: type, field: FieldInfo):
    """`kind` itself when the field has no bounds; else a parser that refuses values outside them, so the
    error names the flag and the range before the engine starts."""
    lo = hi = None
    lo_open = hi_open = False
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            hi, hi_open = m.lt, True
    if lo is None and hi is None:
        return kind
    if lo_open or hi_open:
        allowed = " and ".join(b for b in (lo is not None and f"{'>' if lo_open else '>='} {lo}",
                                           hi is not None and f"{'<' if hi_open else '<='} {hi}") if b)
    else:
        allowed = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        below = lo is not None and (v <= lo if lo_open else v < lo)
        above = hi is not None and (v >= hi if hi_open else v > hi)
        if below or above:
            raise argparse.ArgumentTypeError(f"{v} is out of range; allowed: {allowed}")
        return v
    return parse


def _add(p, flag: str, field: FieldInfo, **overrides) -> None:
    kind, choices = _kind(field.annotation)
    kw = {"help": field.description}
    if field.is_required():
        kw["required"] = True
    else:
        kw["default"] = field.default
    if kind is bool:  # on (or decided) by default: --flag / --no-flag (vLLM's --no-enable-prefix-caching)
        kw["action"] = argparse.BooleanOptionalAction if field.default is not False else "store_true"
    else:
        kw["type"] = _bounded(kind, field)
        if choices:
            kw["choices"] = list(choices)
    p.add_argument(flag, **{**kw, **overrides})


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for name, flag in _engine_flags().items():
        _add(p, flag, EngineConfig.model_fields[name])
    s = p.add_argument_group("speculative decoding")
    for name, flag in SPECULATIVE_FLAGS.items():
        # No defaults: an unset flag is None, so `resolve` tells what was asked for (and a flag from a
        # conflicting JSON key); the ranges are checked together there, one error for every violation.
        extra = {"type": str.upper} if name == "algorithm" else {}  # EAGLE3 or eagle3
        _add(s, flag, SpeculativeConfig.model_fields[name], default=None, **extra)
    s.add_argument("--speculative-config", help='vLLM-style JSON, e.g. {"method": "eagle3", "model": DIR, '
                                                '"num_speculative_tokens": 3}')


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    spec = SpeculativeConfig.resolve(config_json=args.speculative_config,
                                     **{name: getattr(args, _dest(flag)) for name, flag in SPECULATIVE_FLAGS.items()})
    return EngineConfig.make(**{name: getattr(args, _dest(flag)) for name, flag in _engine_flags().items()},
                             speculative=spec)
