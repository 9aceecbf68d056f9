"""Speculation, isolated from the engine loop: a `Proposer` drafts (`drafts.py` holds the hand-offs;
`eagle3.py`, `ngram.py`, `tree.py`, `adaptive/`), the `Verifier` (`tsengine/sample/verify.py`) decides.

The engine and its runner name no method: they call `load_draft_model` and `build_proposer`, and every
method-specific choice is made here.
"""

from __future__ import annotations

from tsengine.speculative.drafts import DraftResources, NoProposer, Proposer


def load_draft_model(spec, target_config, device, dtype):
    """The method's draft model, validated against the target, or None (plain decoding, NGRAM). The runner
    loads it before the target: its aux layers decide what the target's forward returns, and its KV layer
    shares the target's blocks."""
    if spec is None or spec.algorithm != "EAGLE3":
        return None
    from tsengine.eagle3.format import load_head

    return load_head(spec.draft_model_path, target=target_config, device=device, dtype=dtype)


def build_proposer(spec, res: DraftResources) -> Proposer:
    """The configured method's proposer over the runner's head and draft cache (plain decoding: none)."""
    if spec is None:
        return NoProposer()
    if spec.algorithm == "NGRAM":
        from tsengine.speculative.ngram import NgramProposer

        return NgramProposer(spec.num_steps, spec.prompt_lookup_min, spec.prompt_lookup_max, res.device)
    from tsengine.speculative.eagle3 import Eagle3Proposer

    eagle = Eagle3Proposer(res.head, num_steps=spec.num_steps, kv=res.kv, block_size=res.block_size,
                           backend=res.backend, topk=spec.eagle_topk, num_nodes=spec.num_draft_tokens, rule=spec.rule,
                           quantization=spec.draft_model_quantization)
    if res.graph_contexts is not None:
        from tsengine.speculative.draft_graphs import DraftGraphs

        eagle.graphs = DraftGraphs(eagle, res.graph_contexts, res.graph_heat)
    if spec.adaptive:  # NGRAM's drafts carry no q: the rejection rule cannot verify them
        from tsengine.speculative.adaptive.proposer import AdaptiveProposer
        from tsengine.speculative.ngram import NgramProposer

        ngram = NgramProposer(spec.num_steps, spec.prompt_lookup_min, spec.prompt_lookup_max, res.device)
        tree = (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) if spec.is_tree else None
        return AdaptiveProposer(eagle, ngram, steps=spec.num_steps, tree=tree, use_ngram=spec.rule != "rejection")
    return eagle
