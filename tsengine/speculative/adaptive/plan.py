"""What adaptive speculation decides each step (`policy.py`): the way to run it (`Arm`) and, per drafting
request, where its drafts come from (`Plan.sources`)."""

from __future__ import annotations

from dataclasses import dataclass

# A request with nothing worth drafting inside a chain step drafts its last token repeated (`PAD`) where that
# makes the step uniform: a step mixing plain decodes with verify windows runs eagerly (tsengine/model/graphs.py),
# and at 4 requests a round whose chain steps left half their requests plain ran well below plain, where the
# fixed chain of 1 ran above it (measured: docs/benchmarks-journal.md, "The head extends lazily: all four levels").
# Only where drafts without a q can be verified (not under the rejection rule, where `ngram` is off too).
PAD = "pad"


@dataclass(frozen=True)
class Arm:
    """One way to run a step: a chain of `steps` drafts (0: plain), or a tree (topk > 1) of `nodes`."""

    steps: int = 0
    topk: int = 1
    nodes: int = 0

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.steps, self.topk, self.nodes

    @property
    def name(self) -> str:
        return (f"tree {self.steps}x{self.topk}x{self.nodes}" if self.is_tree
                else f"chain {self.steps}" if self.steps else "plain")


@dataclass
class Plan:
    """The decision for one step: the arm, and per drafting request its source (eagle3, ngram, PAD or plain)."""

    arm: Arm
    sources: list[str]
    tokens_per_s: float = 0.0  # predicted, corrected by what the arm delivered (`Correction`)
    raw_tokens_per_s: float = 0.0  # predicted by the lines alone
    explored: bool = False  # chosen to explore (or the warm-up), not as the predicted best
    eager: bool = False  # priced as a step that runs eagerly (`StepCosts.cold`), not as a graph

    @property
    def mixed(self) -> bool:
        """Some requests decode plainly while others verify: the step runs eagerly (tsengine/model/graphs.py)."""
        return 0 < self.sources.count("plain") < len(self.sources)

    @property
    def eagle(self) -> list[bool]:
        return [s == "eagle3" for s in self.sources]

    @property
    def kind(self) -> str:
        """The arm, and for a chain its main source: prompt lookup and the head deliver differently."""
        return self.arm.name + (" ngram" if self._lookup and not self.arm.is_tree else "")

    @property
    def family(self) -> str:
        """What one `Correction` serves: a tree shape, plain decoding, or every chain length of one main
        source. Kept per chain length (the first version), each length's ratio learned only on the steps it
        was chosen, a few dozen, and wandered by ±10% where the lengths' speeds differed by 5-10%: at one
        request the policy ran chains of 2 and 1 where chains of 3 were fastest (in-process, issue 43). The
        lengths are told apart by their own measured steps (`StepCosts.step_seconds`) and acceptance."""
        if self.arm.is_tree or not self.arm.steps:
            return self.arm.name
        return "chain" + (" ngram" if self._lookup else "")

    @property
    def _lookup(self) -> bool:
        return self.sources.count("ngram") > self.sources.count("eagle3")


def kept_rows(sources: list[str], kept: list[int]) -> int:
    """Rows the head kept (`kept`, per request) for the requests drafting from it: its catch-up before it
    drafts for them."""
    return sum(rows for source, rows in zip(sources, kept) if source == "eagle3")
