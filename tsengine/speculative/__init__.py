"""Speculation, isolated from the engine loop: a `Proposer` drafts (`drafts.py` holds the hand-offs;
`eagle3.py`, `ngram.py`, `tree.py`, `adaptive/`), the `Verifier` (`tsengine/sample/verify.py`) decides.

The engine and its runner name no method: they call `load_draft_model` and `build_proposer`, and every
method-specific choice is made here.
"""

from __future__ import annotations

from tsengine.speculative.drafts import DraftResources, NoProposer, Proposer


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


def speculation_problems(spec, draft_vocab_size: int | None = None) -> list[str]:
    """What this method and rule cannot do, for the engine's one start-up refusal
    (`tsengine/engine/compatibility.py`)."""
    return _sampler(spec) + _drafter(spec, draft_vocab_size)


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
        return AdaptiveProposer(eagle, ngram, steps=spec.num_steps, tree=tree, use_ngram=spec.rule != "rejection",
                                prefix_caching=res.prefix_caching)
    return eagle
