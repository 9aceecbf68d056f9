"""Speculation, isolated from the engine loop: a `Proposer` drafts (`drafts.py`, `eagle3.py`, `ngram.py`,
`tree.py`), the `Verifier` decides (`verify.py`)."""

from __future__ import annotations

from tsengine.spec.drafts import NoProposer, Proposer


def build_proposer(spec, runner) -> Proposer:
    """The configured method's proposer over the runner's head and draft cache (plain decoding: none)."""
    if spec is None:
        return NoProposer()
    if spec.algorithm == "NGRAM":
        from tsengine.spec.ngram import NgramProposer

        return NgramProposer(spec.num_steps, spec.prompt_lookup_min, spec.prompt_lookup_max, runner.device)
    from tsengine.spec.eagle3 import Eagle3Proposer

    eagle = Eagle3Proposer(runner.head, spec.num_steps, runner.draft_kv, runner.block_size, runner.backend,
                           spec.eagle_topk, spec.num_draft_tokens, spec.rule, spec.draft_model_quantization)
    if runner.compiled is not None:
        from tsengine.graphs import DraftGraphs

        eagle.graphs = DraftGraphs(eagle, runner.compiled.contexts, runner.compiled.heat)
    if spec.adaptive:  # NGRAM's drafts carry no q: the rejection rule cannot verify them
        from tsengine.spec.adaptive_proposer import AdaptiveProposer
        from tsengine.spec.ngram import NgramProposer

        ngram = NgramProposer(spec.num_steps, spec.prompt_lookup_min, spec.prompt_lookup_max, runner.device)
        tree = (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) if spec.is_tree else None
        return AdaptiveProposer(eagle, ngram, spec.num_steps, tree, use_ngram=spec.rule != "rejection")
    return eagle
