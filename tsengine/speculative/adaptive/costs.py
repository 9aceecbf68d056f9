"""What a step costs, as adaptive speculation learns it while serving (`policy.py` weighs it against the
tokens a plan commits): the target's step, the head's extension and drafting, its catch-up, the rest of the
step, and which shapes run as compiled graphs. Why each rule is shaped as it is: docs/design/adaptive.md."""

from __future__ import annotations

from tsengine.model.graphs import BATCH_BUCKETS, HOT_AFTER, bucket
from tsengine.speculative.adaptive.estimates import LinearCost, RecentMedian, RunningMean
from tsengine.speculative.adaptive.plan import Arm, Plan
from tsengine.speculative.drafts import Proposal

HEAD_SAMPLES = 5  # a shape's head steps before its record prices it (the first few may run eagerly)


class StepCosts:
    def __init__(self):
        # the target step: a line over steps of more than one row (a step mixing decodes with windows runs
        # eagerly: tsengine/model/graphs.py), for shapes without a record of their own; and each uniform plain
        # or chain step's own record per graph batch bucket (`step_seconds`), which prices that shape where
        # it exists. The line is not straight: one row runs MKL's sgemv, more rows oneDNN's packed kernel with
        # a higher floor (tsengine/model/linear.py), and at 4 requests a line fitted from chain steps put
        # plain's 29 ms step at 46 ms (chains of 3 then ran at 0.92x plain's speed through a server). With one
        # correction for every chain length (`Plan.family`), lengths are told apart by their own steps.
        self.target = LinearCost(("base", "eager", "per_chain_row", "per_tree_row"))
        self.step_seconds: dict[tuple[Arm, int], RunningMean] = {}  # `shape_key` -> the target's step seconds
        self.graphs_seen = False  # a step ran through a compiled graph: uniform steps are not eager
        # (arm, graph batch bucket: `shape_key`) -> its uniform decode steps in a row that ran eagerly (0: its
        # last one ran through a compiled graph). A shape compiles only once hot (tsengine/model/graphs.py
        # `Heat`), so an arm chosen now and then (a chain at 16 requests) runs eagerly every time it is chosen:
        # priced as a graph step, such steps cost the adaptive server several plain steps each
        # (docs/benchmarks.md, "Adaptive speculation by default"). Priced eagerly from its first step on, an
        # arm that wins only as a graph never got the steps that heat it: at one request the policy settled
        # on the chain of 1 that heated first (`cold`).
        self.eager_runs: dict[tuple[Arm, int], int] = {}
        # graphs compiled so far in this process (the proposer sets it every step), and its value when each
        # (arm, batch) last ran eagerly: exploration retries such an arm only once a graph has compiled since
        self.compiled = 0
        self._eager_at: dict[tuple[Arm, int], int] = {}
        # the head's time (extension + drafting), learned from steps that draft from it (no other step does
        # head work): a line, and each arm's own record per graph batch bucket of the requests it drafts for
        # (`head_seconds`), which prices that shape once it has `HEAD_SAMPLES`. The line is not identifiable
        # where few shapes run (at one request a forward and a drafted row are the same count), and off the
        # shapes it was fitted on it drifts: a server's line reached 8 ms + -1.4 ms a forward, priced a chain
        # of 3 for 4 requests at no head time at all, and the correction all chain lengths share learned 0.53
        # from its steps, so a chain of 1, 5% faster than plain decoding, never ran (issue 43). A median, not
        # a mean: the head runs eagerly until its own graph compiles, at several times the cost
        self.draft = LinearCost(("base", "per_extended_row", "per_forward", "per_draft_row"))
        self.head_seconds: dict[tuple[Arm, int], RecentMedian] = {}
        # `shape_key` -> the head's drafting steps in a row that ran eagerly where it has graphs: the first
        # `HOT_AFTER` teach nothing (`learn_draft`)
        self.head_eager_runs: dict[tuple[Arm, int], int] = {}
        # prompt lookup's and the decision's apart (every step pays them)
        self.overhead = LinearCost(("base", "per_request"))
        # the head's catch-up over rows kept while it did not draft (a pass of its own: adaptive_proposer)
        self.catch_up = LinearCost(("base", "per_row"))

    # ---- learning ---------------------------------------------------------------------------------------
    def learn_step(self, proposal: Proposal, last: Plan, tree_rows: int, quiet: bool) -> None:
        """The target's decode step that ran `last`; not `quiet`, its time teaches nothing (`policy.learn`),
        but whether it ran as a graph still counts."""
        if proposal.graph and not self.graphs_seen:  # the eager plain steps before it were not the norm
            self.graphs_seen, self.step_seconds = True, {}
        shape = uniform_shape(last, proposal.decode_rows)
        if quiet and shape is not None and (proposal.graph or not self.graphs_seen):
            self.step_seconds.setdefault(shape, RunningMean()).observe(proposal.target_seconds)
        if quiet and proposal.decode_rows > 1:
            self.target.update([1.0, float(not proposal.graph), proposal.decode_rows - tree_rows, tree_rows],
                               proposal.target_seconds)
        if last.sources and not last.mixed:
            key = shape_key(last.arm, len(last.sources))
            self.eager_runs[key] = 0 if proposal.graph else self.eager_runs.get(key, 0) + 1
            self._eager_at[key] = self.compiled

    def learn_draft(self, extended: int, plan: Plan, head_seconds: float | None,
                    overhead_seconds: float | None, graph: bool | None = None) -> float:
        """The head's and the rest of the step's seconds (`AdaptivePolicy.learn_draft`); returns the rest's
        (the line's estimate where it was not measured).

        Where the head has compiled graphs (`graph` not None), a shape's first `HOT_AFTER` eager passes in a
        row teach nothing: they are the passes that heat its graph, the first of them building kernels for
        sizes met for the first time, and not what the shape costs once it runs. A server's warm-up request
        ran the chains eagerly at one request (20, 107 and 386 ms for chains of 1, 2 and 3 drafts, against
        6-14 ms for its graphs in another server); the head's line, fitted on those, priced a chain of 1 for
        4 requests at a quarter of a second, so no chain ran at 4 requests, was ever measured there, or
        explored (docs/benchmarks.md, "Thirteenth run"). Past `HOT_AFTER` the shape is not compiling (no
        fit, or a rare shape): its eager passes are its cost."""
        heads = sum(plan.eagle)
        if heads and graph is not None:
            key = shape_key(plan.arm, heads)
            self.head_eager_runs[key] = 0 if graph else self.head_eager_runs.get(key, 0) + 1
            if 0 < self.head_eager_runs[key] <= HOT_AFTER:
                head_seconds = None
        if head_seconds is not None and heads:
            self.draft.update([1.0, extended, *draft_work(plan.arm, heads)], head_seconds)
            self.head_seconds.setdefault(shape_key(plan.arm, heads), RecentMedian()).observe(head_seconds)
        if overhead_seconds is None:
            return self.overhead.predict([1.0, len(plan.sources)])
        self.overhead.update([1.0, len(plan.sources)], overhead_seconds)
        return overhead_seconds

    # ---- pricing ----------------------------------------------------------------------------------------
    def seconds(self, arm: Arm, tokens: float, chain_rows: int, tree_rows: int, heads: int, batch: int,
                mixed: bool = False, kept: int = 0) -> float:
        """A step of `batch` requests, `heads` of them drafting from the head, `mixed` if some decode plainly
        while others verify. The head's time: its extension over the drafting requests' rows (their share of
        the `tokens`) and its forwards; none where no request drafts from it (it extends over a request's rows
        only when it drafts for it: `Sequence.head_backlog`); first its catch-up over the `kept` rows of those
        requests (`catch_up_seconds`)."""
        seconds = (self.target_seconds(arm, batch, chain_rows, tree_rows, mixed, self.cold(arm, batch))
                   + self.overhead.predict([1.0, batch]))
        if heads:
            seconds += self.head(arm, tokens * heads / batch, heads) + self.catch_up_seconds(kept)
        return seconds

    def head(self, arm: Arm, extended: float, heads: int) -> float:
        """The head's extension over `extended` rows and its drafts for `heads` requests: the shape's own
        record where it has `HEAD_SAMPLES`, else the line."""
        record = self.head_seconds.get(shape_key(arm, heads))
        if record is not None and record.samples >= HEAD_SAMPLES:
            return record.value
        return self.draft.predict([1.0, extended, *draft_work(arm, heads)])

    def target_seconds(self, arm: Arm, batch: int, chain_rows: int, tree_rows: int, mixed: bool = False,
                       cold: bool = False) -> float:
        """The target's step: the shape's own record (`step_seconds`) where it runs as one, else the line (a
        mixed step runs eagerly, and so does a step whose graph is `cold`)."""
        if not mixed and not cold:
            step = self.step_seconds.get(shape_key(arm, batch))
            if step is not None:
                return step.value
        eager = mixed or cold or not self.graphs_seen
        return self.target.predict([1.0, float(eager), chain_rows, tree_rows])

    def catch_up_seconds(self, kept: int) -> float:
        """What drafting from the head costs first where it kept rows for those requests: a pass of its own
        over them. Unpriced, a head step after a stretch of plain steps looked as cheap as one in a run of
        head steps, and at 4 requests the policy went in and out of a chain of 1 (a few percent faster than
        plain decoding when run steadily) and ran below plain decoding (issue 43, docs/benchmarks.md
        "Adaptive speculation by default")."""
        return self.catch_up.predict([1.0, kept]) if kept else 0.0

    def cold(self, arm: Arm, batch: int) -> bool:
        """The arm's step at this batch would run eagerly: its last `HOT_AFTER` steps here did, with no graph
        step since. Fewer than that, it is priced as the graph it becomes when chosen: `HOT_AFTER` steps in a
        row heat its shape and the graph compiles off the engine thread (tsengine/model/graphs.py), and an
        exploration step finds it compiled later. Priced eagerly from its first step on, an arm that wins only
        as a graph never got those steps (at one request, the chain of 1 heated first and the longer chains,
        faster as graphs, were never chosen again)."""
        return self.eager_runs.get(shape_key(arm, batch), 0) >= HOT_AFTER

    def explorable(self, arm: Arm, batch: int) -> bool:
        """Worth an exploration step: the arm's last step at this batch ran through a graph, or a graph has
        compiled since it ran eagerly (its own shape, heated by its eager steps, may be the one: the step
        that finds it compiled prices the arm as a graph again). Otherwise, or never run at this batch (no
        graph can hold a shape never met), it would run eagerly, at up to 10 plain steps' time at 16
        requests (traced: 647 ms for a chain of 3 met for the first time, against 58 ms), teaching its
        correction nothing (`AdaptivePolicy.learn` skips a step priced as a graph that ran eagerly). An arm
        never run at a batch starts there only when chosen as the best: its steps in a row heat its shape."""
        if not arm.steps:  # the baseline: excluded after one eager step (the batch filling up), it was never
            return True  # chosen again where the lines favoured chains, at 0.6x plain's speed (in-process, 4 requests)
        key = shape_key(arm, batch)
        if key not in self.eager_runs:
            return False
        return not self.eager_runs[key] or self.compiled > self._eager_at.get(key, -1)


def draft_work(arm: Arm, heads: int) -> tuple[int, int]:
    """(sequential head forwards, rows drafted) for `heads` requests drafting from the head."""
    if heads == 0 or arm.steps == 0:
        return 0, 0
    if arm.is_tree:
        return arm.steps, heads * (1 + arm.topk * (arm.steps - 1))
    return arm.steps, heads * arm.steps


def uniform_shape(last: Plan, decode_rows: int) -> tuple[Arm, int] | None:
    """The `shape_key` of a step that ran `last`, where it was uniform: a plain or chain step in which every
    request ran the plan's rows (its record, `step_seconds`, prices that shape); else None."""
    n = len(last.sources)
    if decode_rows == 1:
        return shape_key(Arm(0), 1)
    k = last.arm.steps
    if n and not last.arm.is_tree and decode_rows == n * (k + 1) and (not k or "plain" not in last.sources):
        return shape_key(last.arm, n)
    return None


def shape_key(arm: Arm, batch: int) -> tuple[Arm, int]:
    """The arm at the batch size its step's graph is padded to (tsengine/model/graphs.py `BATCH_BUCKETS`): the
    sizes of one bucket share a graph, so they share its eager record. Keyed by the exact size, a server
    whose batch filled up over its first steps met a chain of 1 "for the first time" at 9, 10, ... 16
    requests, ran each eagerly, and lost 2-6% of a round at 16 requests (issue 43)."""
    return arm, graph_batch(batch)


def graph_batch(batch: int) -> int:
    """The batch size a step of `batch` requests is padded to in its graph (itself past the largest bucket)."""
    return bucket(batch, BATCH_BUCKETS) or batch
