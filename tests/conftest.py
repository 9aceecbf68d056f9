"""Shared fixtures: tiny random targets (built once per session), a saved random head per tiny target (once
per module) and the embedded SmolLM2 (real_model).

Fixtures only: pytest finds them without an import, and no test module imports this file (shared plain
helpers are in helpers/, test-only oracles in oracles.py; tests/test_layers.py checks it)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernels run interpreted here
# Engines run eagerly in the default suite: a compiled step graph costs ~10 s per shape here on first use.
# tests/model/test_graphs.py runs the invariants in both modes; `make test-compiled` runs the engine tests compiled.
os.environ.setdefault("TSENGINE_ENFORCE_EAGER", "1")
# Where graphs run, they compile on the step that needs them, so a test proves the graph ran; tests/model/
# test_compile_worker.py proves the default (compiled off the engine thread, eager until ready) loses nothing.
os.environ.setdefault("TSENGINE_GRAPH_COMPILE", "inline")

import pytest
import torch

from tests.helpers.heads import random_head
from tests.tiny import make_target
from tsengine.eagle3.format import save_head


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return {kind: make_target(tmp_path_factory.mktemp(f"tiny-{kind}"), kind=kind, seed=i)
            for i, kind in enumerate(("llama", "qwen3"))}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    from tsengine.targets import load_target

    return {kind: load_target(str(d)) for kind, d in tiny_dirs.items()}


@pytest.fixture(scope="module")
def heads(tiny_dirs, tiny_models, tmp_path_factory):
    """A random head per tiny target with decisive logits (std 0.3: no near-ties among drafts)."""
    out = {}
    for kind, (model, _) in tiny_models.items():
        head = random_head(model, seed=3, draft_vocab_size=256)
        head.init_weights(3, std=0.3)
        out[kind] = save_head(head, tmp_path_factory.mktemp(f"head-{kind}"))
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The embedded target, pulled into the normal cache (converted once per machine)."""
    from tsengine.targets import load_target, pull

    path = pull("smollm2-135m")
    model, tok = load_target(str(path))
    return path, model, tok


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
