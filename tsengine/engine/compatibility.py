"""One startup check of what the requested configuration needs from every component, with every blocker
listed in one refusal. Nothing falls back silently: a tree on a backend without a tree kernel is an
error that says so, not a quiet switch to another backend or to a chain.

Each component answers for itself (`_attention`, speculation's `speculation_problems`, `_quantization`);
`check` collects and refuses once.
"""

from __future__ import annotations

from tsengine.errors import fail_if
from tsengine.speculative import speculation_problems


def _attention(backend: str, spec) -> list[str]:
    return []  # both backends verify chains and trees (ancestor-bitmask windows of <= 64 nodes)


def _quantization(spec, device, dtype) -> list[str]:
    """The bf16 and int8 heads are a CPU kernel's formats (tsengine/model/kernels/rows_linear.cpp): elsewhere, or
    without that kernel, they would run as slowly as fp32 and draft worse, so they are refused rather than
    silently kept."""
    if spec is None or spec.draft_model_quantization == "none" or device is None:
        return []
    import torch

    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return [f"speculative_draft_model_quantization {spec.draft_model_quantization}: the CPU float32 head's "
                f"format; this engine runs the head on {device} in {str(dtype).removeprefix('torch.')}: use none"]
    from tsengine.model.linear import quantization_unavailable

    why = quantization_unavailable()
    return [f"speculative_draft_model_quantization {spec.draft_model_quantization}: {why}: use none"] if why else []


def check(backend: str, spec, draft_vocab_size: int | None = None, device=None, dtype=None) -> None:
    """Raise one UserError listing every blocker of this configuration (or return)."""
    fail_if(_attention(backend, spec) + speculation_problems(spec, draft_vocab_size)
            + _quantization(spec, device, dtype), "this configuration cannot run; every blocker")
