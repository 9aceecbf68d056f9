"""The typed hand-offs between the engine and speculation: what a proposer gets, what it gives back, and the
step's verify windows stacked for the target forward and the verifier.

    commit ──Proposal──▶ Proposer.propose ──Drafts per request──▶ Sequence.drafts
    schedule ──Scheduled(verify)──▶ Windows.stack ──▶ ModelRunner (inputs, tree attention) ──▶ Verifier

A chain is the tree whose node i has parent i − 1 (`Tree.chain`), so the verifier has one acceptance rule
for both; a chain's `Drafts.tree` is None only so that its windows keep plain causal attention (no
bitmask) and nothing is stacked per request.
"""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tsengine.speculative.tree import Tree

if TYPE_CHECKING:
    from tsengine.eagle3.head import Eagle3Head
    from tsengine.engine.scheduler import Scheduled
    from tsengine.model.graphs import Heat
    from tsengine.sequence import Sequence
    from tsengine.speculative.adaptive.policy import AdaptivePolicy


@dataclass
class Drafts:
    """One request's proposal for its next verify window (device tensors; the engine never reads them)."""

    tokens: torch.Tensor  # [N-1] drafted target ids, node 1.. in depth-first order
    _: KW_ONLY
    tree: Tree | None = None  # [N] parents / depths / ancestor bits of this request's tree; None: a chain
    q: torch.Tensor | None = None  # [N-1, Vq] the draft's distribution at each node (the rejection rule only)
    q_ids: torch.Tensor | None = None  # [Vq] the target id of each column of q (the draft vocab)
    source: str = "eagle3"  # who drafted them: eagle3, ngram or pad (adaptive speculation learns per source)


@dataclass(kw_only=True)
class Committed:
    """A run whose positions [start, start + len(rows)) were committed this step: the proposer extends its
    own state over them (`rows`: their rows in the step's flat forward, i.e. of `Proposal.aux`)."""

    seq: "Sequence"
    start: int
    rows: list[int]
    drafts_next: bool  # the run ended at the request's last token: it gets drafts for its next window
    verified: tuple[int, int] | None = None  # a verify window's (drafts, accepted); None for other runs


@dataclass(kw_only=True)
class Proposal:
    runs: list[Committed]
    aux: torch.Tensor | None  # [T, A] the target features of the step's forward (None without aux layers)
    # The step's forward, for cost models: rows of decode/verify windows and of prefill chunks (prefill rows
    # cost less each: many rows share one weight read), and its seconds (schedule to verdicts).
    decode_rows: int = 0
    prefill_rows: int = 0
    target_seconds: float = 0.0
    tokens: int = 0  # tokens the step committed, finished requests' included (what speculation buys)
    graph: bool = False  # the forward ran through a compiled graph (a mixed step runs eagerly: graphs.py)
    queued: int = 0  # requests waiting for a slot: a request finished sooner frees one for them

    @property
    def drafting(self) -> list["Sequence"]:
        """The requests `Proposer.propose` returns drafts for, in this order."""
        return [c.seq for c in self.runs if c.drafts_next]


class Proposer(Protocol):
    """A speculation method: EAGLE-3 (`eagle3.py`), NGRAM (`ngram.py`), adaptive (`adaptive/`); a new one is one
    class. Subclass it to inherit the optional methods' defaults."""

    def propose(self, proposal: Proposal) -> list[Drafts | None]:
        """Drafts for each request of `proposal.drafting` (None: decode it plainly next step)."""

    def adaptive_policy(self) -> "AdaptivePolicy | None":
        """The policy that chooses each step's drafting, when the method adapts (its summary goes to the
        engine's log line and its estimates to /metrics); None for a fixed method."""
        return None


class NoProposer(Proposer):
    """Plain decoding: nothing is ever drafted."""

    def propose(self, proposal: Proposal) -> list[Drafts | None]:
        return []


@dataclass(kw_only=True)
class DraftResources:
    """What the runner hands a proposer at start-up: the method's draft model (None without one), its KV
    layer in the target's blocks, the compiled graphs' context buckets and heat (None: graphs off), and
    whether full blocks are prefix-cached (a block is keyed only once the head covers it)."""

    head: "Eagle3Head | None"
    kv: tuple | None
    block_size: int
    backend: str
    device: torch.device
    graph_contexts: tuple[int, ...] | None = None
    graph_heat: "Heat | None" = None
    prefix_caching: bool = False


@functools.lru_cache(maxsize=8)
def _chain(n: int, device) -> Tree:
    """The one chain of N nodes per device, shared by every step (read only)."""
    return Tree.chain(1, n, device)


@dataclass(kw_only=True)
class Windows:
    """The step's W verify windows of N nodes, stacked once for the forward and the verifier."""

    flat_rows: torch.Tensor  # [W, N] rows of the flat forward batch (node 0: the last committed token)
    logit_rows: torch.Tensor  # [W, N] rows of the step's logits
    starts: torch.Tensor  # [W] KV index of node 0 (the request's num_cached)
    tokens: torch.Tensor  # [W, N-1] drafted target ids
    parents: torch.Tensor  # [W, N]
    depths: torch.Tensor | None  # [W, N]; None: every window is a chain (depth = node index)
    ancestors: torch.Tensor | None  # [W, N]; None likewise
    runs: list["Scheduled"]  # the verify runs, in window order

    @property
    def drafts(self) -> list[Drafts]:
        return [s.seq.drafts for s in self.runs]

    @property
    def is_tree(self) -> bool:
        return self.depths is not None

    @staticmethod
    def stack(at: list[tuple["Scheduled", int, int]], device) -> "Windows":
        """`at`: the step's verify runs, each with its first row in the flat forward and in the logits."""
        runs = [s for s, _, _ in at]
        drafts = [s.seq.drafts for s in runs]
        n = drafts[0].tokens.numel() + 1
        long = dict(dtype=torch.long, device=device)
        ar = torch.arange(n, device=device)
        flat = torch.tensor([row for _, row, _ in at], **long)[:, None] + ar
        logit = torch.tensor([row for _, _, row in at], **long)[:, None] + ar
        starts = torch.tensor([s.start for s in runs], **long)
        tokens = torch.stack([d.tokens for d in drafts])
        if all(d.tree is None for d in drafts):
            return Windows(flat_rows=flat, logit_rows=logit, starts=starts, tokens=tokens,
                           parents=_chain(n, device).parents.expand(len(runs), n), depths=None, ancestors=None,
                           runs=runs)
        chain = _chain(n, device)
        trees = [d.tree if d.tree is not None else Tree(None, chain.parents[0], chain.depths[0], chain.ancestors[0])
                 for d in drafts]
        parents, depths, anc = (torch.stack(x) for x in zip(*((t.parents, t.depths, t.ancestors) for t in trees)))
        return Windows(flat_rows=flat, logit_rows=logit, starts=starts, tokens=tokens, parents=parents, depths=depths,
                       ancestors=anc, runs=runs)
