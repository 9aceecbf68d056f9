"""One startup check of what the requested configuration needs from every component, with every blocker
listed in one refusal. Nothing falls back silently: a tree on a backend without a tree kernel is an
error that says so, not a quiet switch to another backend or to a chain.

Each component answers for itself (`_attention`, `_drafter`, ...); `check` collects and refuses once.
"""

from __future__ import annotations

from tsengine.errors import fail_if


def _attention(backend: str, spec) -> list[str]:
    if spec is not None and spec.is_tree and backend == "triton":
        return ["attention backend triton: no tree-window kernel yet (tree verification needs ancestor masks); "
                "use --attention-backend torch or --speculative-eagle-topk 1"]
    return []


def _drafter(spec, draft_vocab_size: int | None) -> list[str]:
    if spec is None:
        return []
    problems = []
    if spec.algorithm == "NGRAM" and spec.is_tree:
        problems.append(f"drafter NGRAM: drafts a chain (one continuation per match); speculative_eagle_topk "
                        f"{spec.eagle_topk} needs EAGLE3")
    if draft_vocab_size is not None and spec.eagle_topk > draft_vocab_size:
        problems.append(f"drafter EAGLE3: speculative_eagle_topk {spec.eagle_topk} exceeds the head's draft vocab "
                        f"size {draft_vocab_size}")
    return problems


def check(backend: str, spec, draft_vocab_size: int | None = None) -> None:
    """Raise one UserError listing every blocker of this configuration (or return)."""
    fail_if(_attention(backend, spec) + _drafter(spec, draft_vocab_size),
            "this configuration cannot run; every blocker")
