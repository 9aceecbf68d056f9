"""tsengine: train EAGLE-3 draft heads and serve them with lossless speculative decoding.

The public API, as vLLM's: `from tsengine import LLM, SamplingParams`. The names load on first use, so
importing one record (`tsengine.errors`) does not import the engine, torch's compiler or the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "tsengine.entrypoints.llm",
    "SamplingParams": "tsengine.sampling_params",
    "EngineConfig": "tsengine.config",
    "SpeculativeConfig": "tsengine.config",
}
__all__ = ["LLM", "SamplingParams", "EngineConfig", "SpeculativeConfig", "__version__"]

if TYPE_CHECKING:
    from tsengine.config import EngineConfig, SpeculativeConfig
    from tsengine.entrypoints.llm import LLM
    from tsengine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'tsengine' has no attribute {name!r}")
