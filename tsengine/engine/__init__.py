"""The engine core: schedule → run the target → verify → commit → propose (`core.py`), and what it owns:
the scheduler, the model runner, start-up decisions, fault isolation, counters and feature capture.

Entrypoints reach the engine through these names only (tests/test_layers.py)."""

from tsengine.engine.core import Engine, EngineSnapshot, StepOutput

__all__ = ["Engine", "EngineSnapshot", "StepOutput"]
