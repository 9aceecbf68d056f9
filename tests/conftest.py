"""Shared fixtures: tiny random targets (built once per session) and the embedded SmolLM2 (real_model)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernels run interpreted here

import pytest
import torch

from tests.tiny import make_target
from tsengine.eagle3.config import Eagle3Config
from tsengine.eagle3.head import Eagle3Head
from tsengine.eagle3.vocab import vocab_map


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return {kind: make_target(tmp_path_factory.mktemp(f"tiny-{kind}"), kind=kind, seed=i)
            for i, kind in enumerate(("llama", "qwen3"))}


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    from tsengine.targets import load_target

    return {kind: load_target(str(d)) for kind, d in tiny_dirs.items()}


def random_head(model, seed: int = 0, draft_vocab_size: int | None = None, counts=None) -> Eagle3Head:
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab_size)
    head = Eagle3Head(cfg)
    head.init_weights(seed)
    head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, counts))
    head.bind_embeddings(model.get_input_embeddings().weight)
    return head.eval()


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
