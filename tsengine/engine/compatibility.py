"""One startup check of what the requested configuration needs from every component, with every blocker
listed in one refusal. Nothing falls back silently: a tree on a backend without a tree kernel is an
error that says so, not a quiet switch to another backend or to a chain.

Each component answers for itself (`_attention`, `_drafter`, ...); `check` collects and refuses once.
"""

from __future__ import annotations

from tsengine.errors import fail_if


def _attention(backend: str, spec) -> list[str]:
    return []  # both backends verify chains and trees (ancestor-bitmask windows of <= 64 nodes)


def _sampler(spec) -> list[str]:
    """Which verification rule can check which drafts: rejection sampling needs one drafted token per
    position and its recorded q (an EAGLE3 chain); the multi-round rule is the tree's."""
    if spec is None:
        return []
    problems = []
    if spec.speculative_sampling and spec.is_tree:
        problems.append(f"sampler rejection (--enable-speculative-sampling): verifies a chain; speculative_eagle_topk "
                        f"{spec.eagle_topk} drafts a tree: use --spec-tree-sampling multiround for trees")
    if spec.speculative_sampling and spec.algorithm == "NGRAM":
        problems.append("sampler rejection (--enable-speculative-sampling): needs the draft's distribution q; NGRAM "
                        "drafts have none (the default Gumbel rule verifies them exactly)")
    if spec.tree_sampling == "multiround" and not spec.is_tree:
        problems.append("sampler multiround (--spec-tree-sampling multiround): the tree rule; a chain "
                        "(speculative_eagle_topk 1) uses --enable-speculative-sampling")
    return problems


def _drafter(spec, draft_vocab_size: int | None) -> list[str]:
    if spec is None:
        return []
    problems = []
    if spec.algorithm == "NGRAM" and spec.is_tree:
        problems.append(f"drafter NGRAM: drafts a chain (one continuation per match); speculative_eagle_topk "
                        f"{spec.eagle_topk} needs EAGLE3")
    if draft_vocab_size is not None:  # the shape itself was checked with the config: only the head's limit is new
        from tsengine.config import tree_shape_problems

        problems += [f"drafter EAGLE3: {p}" for p in tree_shape_problems(
            spec.num_steps, spec.eagle_topk, spec.num_draft_tokens, draft_vocab_size=draft_vocab_size)]
    return problems


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
    fail_if(_attention(backend, spec) + _sampler(spec) + _drafter(spec, draft_vocab_size)
            + _quantization(spec, device, dtype), "this configuration cannot run; every blocker")
