"""The engine core: one `step()` = schedule → run the target → verify → commit → emit → propose.

    schedule  Scheduler: running requests' decode/verify windows first, then prefill chunks, in one budget
    run       ModelRunner: one flat forward over every run; logits for the rows that draw a token
    verify    Verifier: draws keyed by (seed, position); each verify window accepts its path (one host sync)
    commit    here: num_cached and tokens advance, stop rules finish requests, spare blocks go back
    emit      here: the step's tokens go to the listening server before drafting starts
    propose   Proposer: the speculation method extends its state over the committed rows and drafts

A request's life: server/LLM → `add_request` (a `Sequence`) → `Scheduled` runs → `Forward` → `Verdict` →
committed tokens (`StepOutput`) → `Committed` runs → `Drafts` on the sequence → its next verify window.
Speculation lives behind `Proposer` and `Verifier` (tsengine/speculative/): the engine does not know the method.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tsengine.cache.prefix_cache import PrefixCache, pending_bytes
from tsengine.cache.prefix_cache import salt as prefix_salt
from tsengine.config import EngineConfig
from tsengine.engine.capture import CaptureBuffer, Captured
from tsengine.engine.faults import EngineFault, Quarantine, engine_wide, failure_message
from tsengine.engine.metrics import Stats, StepClock
from tsengine.engine.runner import Forward, ModelRunner
from tsengine.engine.scheduler import Scheduled, Scheduler
from tsengine.engine.startup import reserve_slots
from tsengine.errors import UserError
from tsengine.model import compile_worker
from tsengine.model.graphs import TOKENS_TO_HEAT
from tsengine.sample.sampling import RowParams
from tsengine.sample.verify import Verdict, Verifier
from tsengine.sampling_params import SamplingParams
from tsengine.sequence import Sequence, Status
from tsengine.speculative import build_proposer
from tsengine.speculative.drafts import Committed, Proposal

log = logging.getLogger("tsengine")


@dataclass(kw_only=True)
class StepOutput:
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    verify: bool = False
    accepted: int = 0  # drafts accepted in this step
    captured: Captured | None = None  # a capturing request's features, when it finishes
    error: str | None = None  # finish_reason "error": why this request alone was stopped (tsengine/engine/faults.py)


@dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    """What a monitor reads at scrape time, besides the counters in `Engine.stats`."""

    running: int  # requests scheduled
    waiting: int  # requests queued
    kv_cache_usage: float  # fraction of KV blocks in use
    compiled_graphs: int  # graphs compiled (or loaded from torch's cache) by this process so far
    compiling_graphs: int  # graphs waiting for or in their compile (their steps run eagerly meanwhile)
    prefix_queries: int | None  # prompt tokens looked up in the prefix cache (None: caching off)
    prefix_hits: int | None  # of those, found cached
    policy: object = None  # adaptive speculation's policy (its estimates and choices), when it runs


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer, self.eos_ids = self.runner.tokenizer, set(self.runner.eos_ids)
        self.max_model_len = self.runner.max_model_len
        s = config.speculative
        self.spec_steps = s.num_steps if s else 0
        self.proposer = build_proposer(s, self.runner.draft_resources())
        self.verifier = Verifier(s, self.runner.kv, self.runner.block_size, self.runner.device)
        prefix = None
        if config.enable_prefix_caching:
            root = prefix_salt(self.runner.model_path, (s.draft_model_path or "") if s else "", str(self.runner.dtype))
            prefix = PrefixCache(self.runner.blocks, root, drafter_kv=self.runner.draft_kv is not None,
                                 pending_bytes=pending_bytes(self.runner.kv) if self.proposer.adaptive_policy() else 0)
        self.scheduler = Scheduler(self.runner.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   window=s.num_draft_tokens if s else 1, reserve=reserve_slots(s), prefix=prefix)
        self.requests: dict[str, Sequence] = {}
        self.stats = self._new_stats()
        self.quarantine = Quarantine()
        self.finishing: list[tuple[Sequence, str]] = []  # finished this step, released after drafting
        # where a step's committed outputs go before drafting (the server's streams); None: `step` returns them
        self.emit: Callable[[list[StepOutput]], None] | None = None
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    def _new_stats(self) -> Stats:
        stats, policy = Stats(self.spec_steps), self.proposer.adaptive_policy()
        stats.prefix = self.scheduler.prefix
        stats.describe_policy = policy.describe if policy is not None else None
        return stats

    def warm_up(self, timeout: float | None = None) -> bool:
        """Compile the graphs a first request runs before serving one: a short greedy request through the
        engine makes its shapes hot (batch 1, the first context bucket, the configured drafts), then wait
        for their compiles (tsengine/model/compile_worker.py). The counters start again after it. False if
        `timeout` passed first (the rest compile in the background). Why: a server's first request would
        otherwise run eagerly beside its own graph's compile, several times a warm request's time
        (docs/benchmarks.md, "No request waits for a compile"); the disk cache makes later starts cheap."""
        if self.runner.compiled is None:
            return True
        log.info("warming up: compiling the step graphs a first request runs (cached on disk after)")
        t0 = time.perf_counter()
        prompt = self.tokenizer("Warm up.", add_special_tokens=False)["input_ids"] or [0]
        self.add_request("tsengine-warm-up", prompt, SamplingParams(temperature=0, max_tokens=TOKENS_TO_HEAT,
                                                                    ignore_eos=True))
        while self.has_unfinished():
            self.step()
        done = compile_worker.WORKER.wait(timeout)
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.queries = self.scheduler.prefix.hits = 0
        self.stats = self._new_stats()
        log.info("warmed up in %.1f s%s", time.perf_counter() - t0, "" if done else " (compiles left running)")
        return done

    def compile_when_idle(self) -> None:
        """From now on a compile waits for a moment the engine is idle, at most `SERVER_IDLE_WAIT_S`
        (tsengine/model/compile_worker.py): a server's steps keep the cores while it is busy."""
        compile_worker.WORKER.idle_wait_s = compile_worker.SERVER_IDLE_WAIT_S

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, capture: bool = False) -> None:
        """`capture`: keep the target features of every position (tsengine/engine/capture.py); needs the engine
        built with `capture_layer_ids`."""
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already running")
        self.check_prompt(prompt)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        try:  # the step builds these tensors for every row: a value they cannot hold is refused here, alone
            RowParams.build([params], [seed], "cpu")
        except (OverflowError, RuntimeError, TypeError, ValueError) as e:
            raise UserError(f"invalid sampling parameters: {e}") from None
        seq = Sequence(request_id, list(prompt), params, seed)
        if capture:
            if not self.config.capture_layer_ids:
                raise UserError("capture=True needs the engine built with capture_layer_ids (the aux layers)")
            m = self.runner.model
            size = min(len(prompt) + params.max_tokens, self.max_model_len)
            seq.capture = CaptureBuffer(size, len(m.aux_layer_ids) * m.cfg.hidden_size, m.cfg.hidden_size,
                                        self.runner.dtype, self.runner.device)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats.requests_started += 1

    def check_prompt(self, prompt: list[int]) -> None:
        """The one prompt validation (the server and the offline API call it before queueing): UserError
        naming the field and what is allowed."""
        if not prompt:
            raise UserError("prompt: empty; the model needs at least one token")
        if len(prompt) >= self.max_model_len:
            raise UserError(f"prompt: {len(prompt)} tokens; the context is {self.max_model_len} tokens "
                            "(max_model_len) including at least one generated token")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"prompt: token ids must be in 0..{vocab - 1}")

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- monitoring -------------------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """What /metrics reads at scrape time (from another thread: plain reads, no locks)."""
        sched, blocks, prefix = self.scheduler, self.runner.blocks, self.scheduler.prefix
        return EngineSnapshot(running=len(sched.running), waiting=len(sched.waiting),
                              kv_cache_usage=1 - blocks.num_free / max(1, blocks.num_blocks),
                              compiled_graphs=compile_worker.WORKER.compiled,
                              compiling_graphs=compile_worker.WORKER.pending,
                              prefix_queries=prefix.queries if prefix is not None else None,
                              prefix_hits=prefix.hits if prefix is not None else None,
                              policy=self.proposer.adaptive_policy())

    # ---- one step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """schedule → run → verify → commit → emit → propose (the module docstring)."""
        clock, solo = StepClock(), self.quarantine.solo()
        batch = self.scheduler.schedule(only=solo)
        if not batch:
            return self._idle(solo)
        compile_worker.WORKER.busy()
        try:  # nothing is committed before the verdicts: a failure here leaves every request as it was
            forward = self.runner.run(batch)
            verdicts = self.verifier.verify(batch, forward)
        except Exception as error:
            return self._step_failed(batch, solo, error)
        clock.verified()
        outputs, committed = self._commit(batch, verdicts, forward.first_row)
        tokens, outputs = sum(len(o.new_tokens) for o in outputs), self._emit(outputs)
        clock.committed()
        with self._finishing_after_drafts():
            outputs += self._propose(self._proposal(batch, forward, committed, tokens, clock), solo)
        self._end_step(batch, committed, solo, tokens, clock)
        return outputs

    def _idle(self, solo: Sequence | None) -> list[StepOutput]:
        if solo is not None:  # it cannot get blocks alone: back to ordinary batching, which can preempt
            self.quarantine.release(solo)
        return []

    def _emit(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Out before the drafter runs, where a consumer listens: drafting time is no token's latency."""
        if self.emit is None or not outputs:
            return outputs
        self.emit(outputs)
        return []

    def _proposal(self, batch: list[Scheduled], forward: Forward, committed: list[Committed], tokens: int,
                  clock: StepClock) -> Proposal:
        decode = sum(s.num_tokens for s in batch if s.verify or s.num_tokens == 1)
        return Proposal(runs=committed, aux=forward.aux, decode_rows=decode,
                        prefill_rows=sum(s.num_tokens for s in batch) - decode, target_seconds=clock.target_seconds,
                        tokens=tokens, graph=forward.graph, queued=len(self.scheduler.waiting))

    @contextlib.contextmanager
    def _finishing_after_drafts(self):
        """Requests that finished this step keep their blocks until the proposer has extended over their
        last rows (their last blocks are then complete for the prefix cache); released here, even if
        drafting failed."""
        try:
            yield
        finally:
            for seq, reason in self.finishing:
                if seq.status is not Status.FINISHED:
                    self.scheduler.finish(seq, reason)
            self.finishing.clear()

    def _end_step(self, batch: list[Scheduled], committed: list[Committed], solo: Sequence | None, tokens: int,
                  clock: StepClock) -> None:
        self.scheduler.cache_blocks([c.seq for c in committed])
        if solo is not None:
            self.quarantine.release(solo)
        if self.config.debug_checks:
            self.scheduler.check()
        self.stats.step(tokens, len(batch), clock.finished())

    def _propose(self, proposal: Proposal, solo: Sequence | None) -> list[StepOutput]:
        """Drafts for the next step. A failure here comes after the commit: the tokens stand, the drafter's
        state of these runs does not, so they are recomputed (one at a time, as after a failed step)."""
        try:
            drafts = self.proposer.propose(proposal)
        except Exception as error:
            if engine_wide(error):
                raise EngineFault(f"engine-wide failure while drafting: {type(error).__name__}") from error
            done = {seq for seq, _ in self.finishing}
            if solo is not None and solo.status is not Status.FINISHED and solo not in done:
                log.error("request %s failed while drafting and is stopped", solo.request_id, exc_info=error)
                return [self._fail(solo, failure_message(error))]
            seqs = [c.seq for c in proposal.runs if c.seq not in done]
            log.warning("drafting failed (%s); recomputing its %d request(s), one at a time",
                        type(error).__name__, len(seqs), exc_info=error)
            for seq in seqs:
                self.scheduler.preempt(seq)  # recompute rebuilds the drafter's state from the tokens
            self.quarantine.add(seqs)
            return []
        for seq, d in zip(proposal.drafting, drafts + [None] * (len(proposal.drafting) - len(drafts))):
            seq.drafts = d  # a proposer may return fewer: the rest decode plainly
        return []

    def _step_failed(self, batch: list[Scheduled], solo: Sequence | None, error: Exception) -> list[StepOutput]:
        """A step raised before committing anything. Alone in its step, a request is the cause and stops
        with reason "error"; otherwise the step's requests are retried one per step (tsengine/engine/faults.py)."""
        if engine_wide(error):
            raise EngineFault(f"engine-wide failure: {type(error).__name__}; every open request is stopped") from error
        seqs = list(dict.fromkeys(s.seq for s in batch if s.seq.status is not Status.FINISHED))
        if solo is None and len(seqs) > 1:
            log.warning("a step of %d requests failed (%s); retrying them one at a time to find the cause",
                        len(seqs), type(error).__name__, exc_info=error)
            self.quarantine.add(seqs)
            return []
        log.error("request %s failed and is stopped", [s.request_id for s in seqs], exc_info=error)
        return [self._fail(seq, failure_message(error)) for seq in seqs]

    def _fail(self, seq: Sequence, message: str) -> StepOutput:
        self.scheduler.finish(seq, "error")
        self.requests.pop(seq.request_id, None)
        self.quarantine.release(seq)
        return StepOutput(request_id=seq.request_id, new_tokens=[], finished=True, finish_reason="error",
                          error=message)

    def _commit(self, batch: list[Scheduled], verdicts: list[Verdict | None],
                first_rows: list[int]) -> tuple[list[StepOutput], list[Committed]]:
        """Advance each run's request by its verdict: cached positions, tokens up to a stop, finish or trim.
        Returns the step's outputs and the runs the proposer extends over (their committed rows)."""
        outputs, committed = [], []
        for s, verdict, first in zip(batch, verdicts, first_rows):
            seq = s.seq
            if seq.status is Status.FINISHED:  # aborted meanwhile
                continue
            if verdict is not None and verdict.error is not None:  # its rows only: the others commit
                outputs.append(self._fail(seq, verdict.error))
                continue
            seq.num_cached += len(verdict.path) if s.verify else s.num_tokens
            if s.verify:
                seq.verify_steps += 1
                seq.accepted += verdict.accepted
                self.stats.verified(verdict.accepted, s.num_tokens - 1)
            kept, reason = self._append(seq, verdict.tokens if verdict is not None else [])
            rows = [first + j for j in verdict.path] if s.verify else list(range(first, first + s.num_tokens))
            if reason:  # it keeps its blocks until the proposer has extended over these rows too (`step`):
                self.requests.pop(seq.request_id, None)  # then its last blocks are complete for the prefix cache
                self.finishing.append((seq, reason))
                rows = rows[:max(0, len(seq.tokens) - 1 - s.start)]  # a stop may cut the accepted path short
            else:
                self.scheduler.trim(seq)
            if rows:
                committed.append(Committed(seq=seq, start=s.start, rows=rows, drafts_next=s.samples and not reason,
                                           verified=(s.num_tokens - 1, verdict.accepted) if s.verify else None))
            if kept or reason:
                captured = seq.capture.result(len(seq.tokens)) if reason and seq.capture is not None else None
                outputs.append(StepOutput(request_id=seq.request_id, new_tokens=kept, finished=reason is not None,
                                          finish_reason=reason, verify=s.verify,
                                          accepted=verdict.accepted if s.verify else 0, captured=captured))
        return outputs, committed

    def _append(self, seq: Sequence, new: list[int]) -> tuple[list[int], str | None]:
        """Commit `new` tokens up to the first stop; returns (kept tokens, finish reason or None)."""
        p, kept = seq.params, []
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        for t in new:
            seq.tokens.append(t)
            kept.append(t)
            if t in stops:
                return kept, "stop"
            if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                return kept, "length"
        return kept, None
