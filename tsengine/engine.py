"""The engine core: one `step()` = schedule → one target forward → sample/verify → commit → draft.

    target forward   prefill chunks + verify windows [last token, d1..dS] of every request, one flat batch
    sample / verify  draws keyed by (seed, position) for the rows that need a token; a verify window
                     accepts its longest prefix of drafts equal to the target's draws, plus one bonus draw
    commit           num_cached and tokens advance; stop rules truncate; rejected slots are simply
                     overwritten later (both caches), blocks past the next step's need go back
    draft            the head extends its cache over the newly committed positions and drafts S tokens

Exactly one host sync per step: the sampled tokens and accept lengths come back together (the scheduler
and the stop rules need them). Drafts stay on the device and are scattered into the next input.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tsengine import kv_cache
from tsengine.capture import CaptureBuffer, Captured, full_argmax
from tsengine.config import EngineConfig
from tsengine.context import Context
from tsengine.errors import UserError
from tsengine.metrics import Stats
from tsengine.runner import Runner, reserve_slots
from tsengine.sampling import RowParams, SamplingParams, filtered_logprobs, gumbel, sample
from tsengine.scheduler import Scheduler
from tsengine.sequence import Sequence, Status
from tsengine.spec.tree import Tree

log = logging.getLogger("tsengine")


@dataclass
class StepOutput:
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    verify: bool = False
    accepted: int = 0  # drafts accepted in this step
    captured: Captured | None = None  # a capturing request's features, when it finishes


@dataclass
class Request:
    seq: Sequence
    arrival: float = field(default_factory=time.monotonic)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = Runner(config)
        self.tokenizer, self.eos_ids = self.runner.tokenizer, set(self.runner.eos_ids)
        self.max_model_len = self.runner.max_model_len
        s = config.speculative
        self.spec_steps = s.num_steps if s else 0
        self.window = s.num_draft_tokens if s else 1  # N: the root plus the drafts
        self.tree = bool(s and s.is_tree)
        self.rule = s.rule if s else "gumbel"
        self._chain_parents = Tree.chain(1, self.window, self.runner.device).parents  # [1, N]: parent[i] = i - 1
        self.scheduler = Scheduler(self.runner.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.window, reserve_slots(s))
        self.requests: dict[str, Sequence] = {}
        self.stats = Stats(self.spec_steps)
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, capture: bool = False) -> None:
        """`capture`: keep the target features of every position (tsengine/capture.py); needs the engine
        built with `capture_layer_ids`."""
        if request_id in self.requests:
            raise UserError(f"request id {request_id!r} is already running")
        if not prompt:
            raise UserError("prompt: empty; the model needs at least one token")
        if len(prompt) >= self.max_model_len:
            raise UserError(f"prompt: {len(prompt)} tokens; the context is {self.max_model_len} tokens "
                            "(max_model_len) including at least one generated token")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"prompt: token ids must be in 0..{vocab - 1}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
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

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        r, dev, S, N = self.runner, self.runner.device, self.spec_steps, self.window
        long = dict(dtype=torch.long, device=dev)
        ids, runs, draft_slots, drafts, rows, row_seq, row_pos = [], [], [], [], [], [], []
        vstart, vbase, vseqs = [], [], []  # per verify window: first sampled row, first token index, sequence
        plain_rows = []  # sampled rows outside verify windows (a prefill chunk's or a decode token's last row)
        bases = []  # each scheduled run's first row in the flat batch
        for s in batch:
            seq, base = s.seq, len(ids)
            bases.append(base)
            runs.append((seq.table, s.start, s.num_tokens))
            if s.verify:
                ids.extend([seq.tokens[-1]] + [0] * (N - 1))
                draft_slots.extend(range(base + 1, base + N))
                drafts.append(seq.drafts)
                vbase.append(base)
                vseqs.append(seq)
            else:
                ids.extend(seq.tokens[s.start:s.start + s.num_tokens])
            if s.samples:  # rows whose logits draw a token: the whole window, or the chunk's last row
                first = base if s.verify else base + s.num_tokens - 1
                (vstart if s.verify else plain_rows).append(len(rows))
                rows.extend(range(first, base + s.num_tokens))
                row_seq.extend([seq] * (base + s.num_tokens - first))
                row_pos.extend(range(s.start + (first - base) + 1, s.start + s.num_tokens + 1))
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        if drafts:
            input_ids[torch.tensor(draft_slots, **long)] = torch.cat(drafts)
        ctx = Context.build(runs, r.block_size, dev)
        row_pos = torch.tensor(row_pos, **long)
        if drafts:
            vrow = torch.tensor(vstart, **long)[:, None] + torch.arange(N, device=dev)  # [W, N] sampled rows
            if self.tree:  # position follows depth (RoPE and draws), slot follows node index
                parents, depths, anc = (torch.stack(x) for x in zip(*(q.tree for q in vseqs)))
                starts = torch.tensor([q.num_cached for q in vseqs], **long)
                ctx.set_trees(torch.tensor(vbase, **long)[:, None] + torch.arange(N, device=dev), starts, depths, anc)
                row_pos[vrow] = starts[:, None] + depths + 1
            else:
                parents = self._chain_parents.expand(len(vseqs), N)
        hidden, aux = r.model(input_ids, ctx, r.kv)
        drafted = torch.stack(drafts) if drafts else None  # [W, N-1]
        rp = RowParams.build([q.params for q in row_seq], [q.seed for q in row_seq], dev)
        logits = r.model.logits(hidden[torch.tensor(rows, **long)])
        noise = None
        if self.tree and drafts and not rp.all_greedy:
            other = torch.tensor(plain_rows, **long)
            noise = self._tree_noise(rp, row_pos, vrow, other, starts, depths, logits.shape[-1])
        draws = sample(logits, rp, row_pos, noise)
        self._capture(batch, bases, hidden, aux, rows, logits)
        if drafts and self.rule != "gumbel" and not rp.all_greedy:
            self._rule_draws(draws, logits, rp, row_pos, vrow, vseqs, drafted, parents)
        ok = None
        if drafts:  # a node is accepted when its token is its parent's draw and its parent is accepted
            d = draws[vrow]
            match = torch.cat([torch.ones_like(d[:, :1], dtype=torch.bool),
                               drafted == d.gather(1, parents)[:, 1:]], dim=1)
            ok = match
            for _ in range(S):  # one level deeper per pass (depth ≤ S); a chain is the cumulative product
                ok = match & ok.gather(1, parents)
        t1 = time.perf_counter()
        # The one host sync of the step: stop rules and the scheduler need the tokens.
        draws_h = draws.tolist()
        ok_h = ok.tolist() if ok is not None else []
        outputs, ext, moves, i, v = [], [], [], 0, 0
        for s, base in zip(batch, bases):
            seq = s.seq
            if s.verify:
                path = [j for j, good in enumerate(ok_h[v]) if good]  # the accepted path, root first (DFS order)
                v += 1
                a = len(path) - 1
                new = [draws_h[i + j] for j in path]
                i += N
            elif s.samples:
                new = [draws_h[i]]
                i += 1
            else:
                new = []
            if seq.status is Status.FINISHED:  # aborted meanwhile
                continue
            if s.verify:
                seq.num_cached += a + 1
                seq.verify_steps += 1
                seq.accepted += a
                self.stats.verified(a)
            else:
                seq.num_cached += s.num_tokens
            kept, reason = self._append(seq, new)
            if reason:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            else:
                if s.verify and path[-1] != a:  # one owner for the accepted path: it moves to slots start..start+a
                    moves.append((seq.table, s.start, path))
                self.scheduler.trim(seq)
                if S:
                    ext.append((s, [base + j for j in path] if s.verify else range(base, base + s.num_tokens)))
            if kept or reason:
                captured = seq.capture.result(len(seq.tokens)) if reason and seq.capture is not None else None
                outputs.append(StepOutput(seq.request_id, kept, reason is not None, reason, s.verify,
                                          a if s.verify else 0, captured))
        if moves:
            self._move_paths(moves)
        t2 = time.perf_counter()
        if ext:
            self._draft(ext, aux, dev)
        if self.config.debug_checks:
            self.scheduler.check()
        self.stats.step(sum(len(o.new_tokens) for o in outputs), len(batch), t0, t1, t2, time.perf_counter())
        return outputs

    def _capture(self, batch, bases: list[int], hidden, aux, rows: list[int], logits) -> None:
        """Keep the rows of capturing runs at their positions. The argmax of a sampled row comes from the
        logits the step formed anyway; only prefill interiors need their own. Which rows are which is
        host bookkeeping (no sync); the index tensors go over without waiting."""
        runs = [(s, base) for s, base in zip(batch, bases) if s.seq.capture is not None]
        if not runs:
            return
        dev = hidden.device
        logit_of = {row: i for i, row in enumerate(rows)}  # the step's sampled rows -> their logits row
        interior, last_rows, last_logits = [], [], []
        for s, base in runs:
            end = base + s.num_tokens
            last = logit_of.get(end - 1)
            interior.extend(range(base, end if last is None else end - 1))
            if last is not None:
                last_rows.append(end - 1)
                last_logits.append(last)

        def index(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long).to(dev, non_blocking=True)

        arg = torch.empty(hidden.shape[0], dtype=torch.long, device=dev)
        if interior:
            at = index(interior)
            arg[at] = full_argmax(self.runner.model, hidden[at])
        if last_rows:
            arg[index(last_rows)] = logits[index(last_logits)].argmax(-1)
        for s, base in runs:
            end = base + s.num_tokens
            s.seq.capture.write(s.start, aux[base:end], hidden[base:end], arg[base:end])

    def _tree_noise(self, rp: RowParams, row_pos, vrow, other, starts, depths, vocab: int) -> torch.Tensor:
        """Gumbel noise of every sampled row (`other`: the rows outside tree windows), hashed once per (seed,
        position): the nodes of a window at equal depth draw at the same position, so a window needs S+1
        noise rows, not N."""
        (w, _), dev, s1 = vrow.shape, vrow.device, self.spec_steps + 1
        index = torch.empty(row_pos.shape[0], dtype=torch.long, device=dev)
        index[other] = torch.arange(other.numel(), device=dev)
        index[vrow] = other.numel() + torch.arange(w, device=dev)[:, None] * s1 + depths
        seeds = torch.cat([rp.seeds[other], rp.seeds[vrow[:, 0]].repeat_interleave(s1)])
        pos = torch.cat([row_pos[other], (starts[:, None] + 1 + torch.arange(s1, device=dev)).flatten()])
        return gumbel(seeds, pos, vocab)[index]

    def _rule_draws(self, draws, logits, rp: RowParams, row_pos, vrow, vseqs, drafts, parents) -> None:
        """Replace the sampled verify rows' draws by the configured rule's (rejection or multiround), in
        place; greedy rows keep the plain argmax."""
        from tsengine.spec.verify import multiround_draws, rejection_draws

        (w, n), flat = vrow.shape, vrow.flatten()
        rpw = rp.index(flat)
        logp = filtered_logprobs(logits[flat], rpw).view(w, n, -1)
        seeds, pos = rpw.seeds.view(w, n)[:, 0], row_pos[vrow]
        if self.rule == "rejection":  # q over the draft vocab, scattered into the target's
            ids = self.runner.drafter.draft_ids_in_target
            empty = logp.new_zeros(n - 1, ids.numel())  # greedy rows: never read (they keep exact matching)
            if any(s.draft_q is None and not s.params.greedy for s in vseqs):
                raise RuntimeError("a sampled request reached verification without its recorded q")
            q = logp.new_zeros(w, n - 1, logp.shape[-1])
            q[..., ids] = torch.stack([s.draft_q if s.draft_q is not None else empty for s in vseqs])
            new = rejection_draws(logp, drafts, q, seeds, pos)
        else:
            tokens = torch.cat([drafts[:, :1], drafts], dim=1)  # node 0's token is never read
            new = multiround_draws(logp, tokens, parents, seeds, pos, self.config.speculative.eagle_topk)
        draws[flat] = torch.where(rpw.temperature > 0, new.flatten(), draws[flat])

    def _move_paths(self, moves: list) -> None:
        """Accepted tree nodes sit at their node's slot (start + node); move them to start + depth so that
        everything downstream sees a chain. Trimmed blocks are not reused before this (same step)."""
        bs, src, dst = self.runner.block_size, [], []
        for table, start, path in moves:
            for depth, node in enumerate(path):
                if node != depth:
                    src.append(kv_cache.slot(table, start + node, bs))
                    dst.append(kv_cache.slot(table, start + depth, bs))
        long = dict(dtype=torch.long, device=self.runner.device)
        kv_cache.move_slots(self.runner.kv_buf, torch.tensor(src, **long), torch.tensor(dst, **long))

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

    def _draft(self, ext: list, aux: torch.Tensor, dev) -> None:
        """Extend the draft cache over each run's committed positions with the target features of the rows
        that produced them (`ext`: (run, its flat rows) — a verify window's accepted path, or a prefill
        chunk's tokens), then draft for the runs that sampled. NGRAM has no cache: it looks up the tokens."""
        if self.config.speculative.algorithm == "NGRAM":
            self.runner.drafter.draft([s.seq for s, _ in ext if s.samples])
            return
        runs, rows, ids, last, need = [], [], [], [], []
        for s, run_rows in ext:
            seq, n = s.seq, len(run_rows)
            runs.append((seq.table, s.start, n))
            rows.extend(run_rows)
            ids.extend(seq.tokens[s.start + 1:s.start + n + 1])
            if s.samples:
                last.append(len(rows) - 1)
                need.append(seq)
        r = self.runner
        ctx = Context.build(runs, r.block_size, dev)
        width = max(len(q.table) for q in need) if need else 0
        tables = torch.tensor([q.table + [0] * (width - len(q.table)) for q in need], dtype=torch.long).to(dev)
        rp = RowParams.build([q.params for q in need], [q.seed for q in need], dev)
        long = dict(dtype=torch.long, device=dev)
        out = r.drafter.extend_and_draft(torch.tensor(ids, **long), aux[torch.tensor(rows, **long)], ctx,
                                         torch.tensor(last, dtype=torch.long, device=dev), tables, rp)
        for j, q in enumerate(need):
            if self.tree:
                q.drafts, q.tree = out.tokens[j, 1:], (out.parents[j], out.depths[j], out.ancestors[j])
            else:
                # q is cloned: a view would keep the whole batch's [D, S, vocab] alive past this request's verify
                q.drafts, q.draft_q = out[0][j], (out[1][j].clone() if out[1] is not None else None)
