"""Verification: every row that draws a token draws it here, and every verify window accepts its path here.

`Verifier.verify` is the engine's one call: it samples the step's rows (keyed Gumbel, the default rule,
which reproduces plain sampling's seeded tokens), lets the configured rule replace the verify rows' draws,
walks each window's accepted path, moves accepted tree nodes' KV to chain order, and returns one `Verdict`
per run. The accept rule is one for every method and shape: a node is accepted when its token is its
parent's draw and its parent is accepted; the bonus token is the last accepted node's draw.

Below it, the two rules at temperature > 0 that keep the target's distribution without reproducing
plain sampling's seeded tokens: rejection sampling for a chain, the point-mass multi-round rule for a tree.

Both are written as "the draw each node makes", the same currency as the default Gumbel rule: a node's
draw is the child it accepts or, when it accepts none, a sample from what is left of p. The engine's one
acceptance rule (a node is accepted when its token is its parent's draw and its parent is accepted) then
walks the path unchanged. Rejected children can never equal the residual draw: a rejected x has
p(x) ≤ q(x), so the residual gives it zero mass (chain), or x was removed from p (multi-round).

All randomness is keyed like `tsengine.sample.sampling`: (request seed, draw position, stream). Stream 0 is plain
sampling's, 1 the drafter's own samples, 2 the acceptance uniforms, 3 and 4 the residual draws.
Comparisons of a uniform against a probability run in float64, where u·r(x) < r(x) holds exactly for
u < 1 (in float32 the product can round up to r(x) and reject a child that holds all remaining mass). The noise a
node uses at one position is shared by nodes of the same depth in other subtrees; only one of them is ever
on the accepted path, so the draws along the path stay independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsengine.cache import kv_cache
from tsengine.sample.sampling import RowParams, filtered_logprobs, gumbel, sample, uniform
from tsengine.sequence import Status

ACCEPT, RESIDUAL, RESIDUAL_LO = 2, 3, 4  # noise streams
NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request; it was stopped"


def _residual_draw(dist: torch.Tensor, fallback: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Sample from unnormalised `dist` [W, N, V] by inverting its CDF with one keyed uniform per row (one
    hash per row instead of one per vocab entry, as Gumbel-max would need). An all-zero row (float rounding
    left no mass: probability ~1e-7) samples `fallback` instead; rows that reach this are otherwise
    impossible."""
    w, n, v = dist.shape
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, fallback).double()
    cdf = dist.cumsum(-1)
    seeds, pos = seeds.repeat_interleave(n), pos.flatten()
    # 46 random bits from two 23-bit uniforms: one grid step (2^-46) is far below any token's mass, where a
    # single float32 uniform would round every probability to a multiple of 2^-23.
    hi, lo = (uniform(seeds, pos, 1, stream=s)[:, 0].double() for s in (RESIDUAL, RESIDUAL_LO))
    u = ((torch.floor(hi * (1 << 23)) + lo) * 2.0 ** -23).view(w, n, 1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, u, right=True)  # the first id whose CDF exceeds u: it has mass
    # u rounded up to the total: the last id with mass
    last = v - 1 - (dist.flip(-1) > 0).int().argmax(-1, keepdim=True)
    return torch.minimum(idx, last)[..., 0]


def rejection_draws(logp: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, seeds: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """Chain speculative sampling (Leviathan et al. 2023, Chen et al. 2023).
    logp [W, N, V]: the target's filtered log-probs at the window's rows (N = S + 1); drafts [W, S]: the
    drafted token ids, sampled from q [W, S, V] (target vocab); pos [W, N]: each row's draw position.
    Row i < S accepts draft i+1 when u·q(x) < p(x), else draws from norm(relu(p − q)); row S draws the
    bonus from p. Returns [W, N] draws."""
    w, n, _ = logp.shape
    s = n - 1
    p = logp.exp()
    x = drafts[..., None]
    px, qx = p[:, :s].gather(-1, x)[..., 0], q.gather(-1, x)[..., 0]
    u = uniform(seeds.repeat_interleave(s), pos[:, :s].flatten(), 1, stream=ACCEPT).view(w, s)
    accept = u.double() * qx.double() < px.double()
    residual = torch.cat([(p[:, :s] - q).clamp_min(0), p[:, s:]], dim=1)
    draw = _residual_draw(residual, p, seeds, pos)
    return torch.cat([torch.where(accept, drafts, draw[:, :s]), draw[:, s:]], dim=1)


def multiround_draws(logp: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, seeds: torch.Tensor,
                     pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Point-mass multi-round rule (SpecInfer's, with deterministic drafts). Each node tries its children in
    node order (depth-first numbering puts the best child first): accept child x with probability
    r(x) / Σr, else set r(x) = 0 and try the next; r starts as p. With none accepted, draw from r.
    tokens/parents [W, N] (node 0 the root); at most `topk` children per node. Returns [W, N] draws."""
    w, n, _ = logp.shape
    p = logp.exp()
    r = p.clone()  # removed children are zeroed in place: one copy of [W, N, V], not one per round
    nodes = torch.arange(n, device=logp.device)
    child = parents[:, None, 1:] == nodes[None, :, None]  # [W, N, N-1]: node c+1 is a child of node v
    rank = child.cumsum(-1) * child  # 1 for the first child in node order, 2 for the next, ...
    kids = tokens[:, None, 1:]
    u = uniform(seeds.repeat_interleave(n), pos.flatten(), topk, stream=ACCEPT).view(w, n, topk)
    draw = torch.zeros(w, n, dtype=torch.long, device=logp.device)
    done = torch.zeros(w, n, dtype=torch.bool, device=logp.device)
    for j in range(topk):  # K rounds, each over every node of every window at once
        sel = rank == j + 1
        has = sel.any(-1) & ~done
        x = (kids * sel).sum(-1, keepdim=True)  # [W, N, 1]; 0 where the node has no j-th child
        rx = r.gather(-1, x)
        take = has & (u[..., j].double() * r.sum(-1).double() < rx[..., 0].double())
        draw = torch.where(take, x[..., 0], draw)
        done |= take
        r.scatter_(-1, x, torch.where((has & ~take)[..., None], torch.zeros_like(rx), rx))
    return torch.where(done, draw, _residual_draw(r, p, seeds, pos))


@dataclass
class Verdict:
    """What one run's step decided: the tokens it commits and, for a verify window, the accepted path."""

    tokens: list[int]
    path: list[int] | None = None  # accepted nodes, root (node 0) first; None: a plain draw
    error: str | None = None  # the run's logits were not finite: it commits nothing and stops

    @property
    def accepted(self) -> int:
        return len(self.path) - 1 if self.path is not None else 0


def accepted_nodes(draws: torch.Tensor, drafted: torch.Tensor, parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[W, N] bool: node i is accepted when its token is its parent's draw and its parent is accepted. One
    level deeper per pass (depth ≤ max_depth); for a chain it is the cumulative product of the matches."""
    match = torch.cat([torch.ones_like(draws[:, :1], dtype=torch.bool), drafted == draws.gather(1, parents)[:, 1:]],
                      dim=1)
    ok = match
    for _ in range(max_depth):
        ok = match & ok.gather(1, parents)
    return ok


class Verifier:
    def __init__(self, spec, kv: list, block_size: int, device):
        self.rule = spec.rule if spec is not None else "gumbel"
        self.max_depth = spec.num_steps if spec is not None else 0
        self.topk = spec.eagle_topk if spec is not None else 1
        self.kv, self.block_size, self.device = kv, block_size, device

    def verify(self, batch, forward) -> list[Verdict | None]:
        """One `Verdict` per scheduled run (None for a run that draws nothing: a prefill chunk short of the
        last token). Holds the step's one host sync: the commit needs the tokens."""
        params, seeds, plain = [], [], []  # per row of forward.logits; plain: rows outside verify windows
        for s in batch:
            if s.samples:
                if not s.verify:
                    plain.append(len(params))
                rows = s.num_tokens if s.verify else 1
                params.extend([s.seq.params] * rows)
                seeds.extend([s.seq.seed] * rows)
        rp, pos, w = RowParams.build(params, seeds, self.device), forward.draw_positions, forward.windows
        # NaN/inf never reach argmax or sampling. One pass over the logits: a NaN or ±inf anywhere in a row
        # makes its sum non-finite (isfinite(...).all(-1) took four passes, a measurable share of a batch-1 step
        # over a large vocab: docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"). A row of finite
        # logits so large that their sum overflows fp32 (|logit| ~1e34) also fails, as a broken row.
        finite = torch.isfinite(forward.logits.sum(-1))
        forward.logits.masked_fill_(~finite[:, None], 0.0)  # such rows draw from zeros and their run fails
        noise = None
        if w is not None and w.is_tree and not rp.all_greedy:
            noise = self._tree_noise(rp, pos, w, plain, forward.logits.shape[-1])
        draws = sample(forward.logits, rp, pos, noise)
        ok = None
        if w is not None:
            if self.rule != "gumbel" and not rp.all_greedy:
                self._rule_draws(draws, forward.logits, rp, pos, w)
            ok = accepted_nodes(draws[w.logit_rows], w.tokens, w.parents, self.max_depth)
        draws = draws.masked_fill(~finite, -1)  # -1 marks a non-finite row: its verdict fails, no extra sync
        draws_h, ok_h = draws.tolist(), (ok.tolist() if ok is not None else [])  # the host sync
        verdicts, moves, row, window = [], [], 0, 0
        for s in batch:
            rows = s.num_tokens if s.verify else int(s.samples)
            if min(draws_h[row:row + rows], default=0) < 0:
                verdicts.append(Verdict([], error=NON_FINITE))
                row, window = row + rows, window + int(s.verify)
                continue
            if s.verify:
                path = [j for j, good in enumerate(ok_h[window]) if good]  # depth-first: root first
                verdicts.append(Verdict([draws_h[row + j] for j in path], path))
                if path[-1] != len(path) - 1 and s.seq.status is not Status.FINISHED:
                    moves.append((s.seq.table, s.start, path))
                row, window = row + s.num_tokens, window + 1
            elif s.samples:
                verdicts.append(Verdict([draws_h[row]]))
                row += 1
            else:
                verdicts.append(None)
        if moves:
            self.move_accepted(moves)
        return verdicts

    def move_accepted(self, moves: list) -> None:
        """Accepted tree nodes sit at their node's slot (start + node); move them to start + depth so that
        everything downstream sees a chain. Blocks the commit trims are not reused before this (same step)."""
        bs, src, dst = self.block_size, [], []
        for table, start, path in moves:
            for depth, node in enumerate(path):
                if node != depth:
                    src.append(kv_cache.slot(table, start + node, bs))
                    dst.append(kv_cache.slot(table, start + depth, bs))
        long = dict(dtype=torch.long, device=self.device)
        kv_cache.move_slots(self.kv, torch.tensor(src, **long), torch.tensor(dst, **long))

    def _tree_noise(self, rp: RowParams, pos: torch.Tensor, w, plain: list[int], vocab: int) -> torch.Tensor:
        """Gumbel noise of every drawing row, hashed once per (seed, position): the nodes of a window at equal
        depth draw at the same position, so a window needs S+1 noise rows, not N."""
        dev, s1 = self.device, self.max_depth + 1
        other = torch.tensor(plain, dtype=torch.long).to(dev, non_blocking=True)
        vrow, count = w.logit_rows, w.logit_rows.shape[0]
        index = torch.empty(pos.shape[0], dtype=torch.long, device=dev)
        index[other] = torch.arange(other.numel(), device=dev)
        index[vrow] = other.numel() + torch.arange(count, device=dev)[:, None] * s1 + w.depths
        seeds = torch.cat([rp.seeds[other], rp.seeds[vrow[:, 0]].repeat_interleave(s1)])
        at = torch.cat([pos[other], (w.starts[:, None] + 1 + torch.arange(s1, device=dev)).flatten()])
        return gumbel(seeds, at, vocab)[index]

    def _rule_draws(self, draws: torch.Tensor, logits: torch.Tensor, rp: RowParams, pos: torch.Tensor, w) -> None:
        """Replace the sampled verify rows' draws by the configured rule's (rejection or multiround), in
        place; greedy rows keep the plain argmax."""
        (count, n), flat = w.logit_rows.shape, w.logit_rows.flatten()
        rpw = rp.index(flat)
        logp = filtered_logprobs(logits[flat], rpw).view(count, n, -1)
        seeds, at = rpw.seeds.view(count, n)[:, 0], pos[w.logit_rows]
        if self.rule == "rejection":  # q over the draft vocab, scattered into the target's
            drafts = w.drafts
            if any(d.q is None and not s.seq.params.greedy for d, s in zip(drafts, w.runs)):
                raise RuntimeError("a sampled request reached verification without its recorded q")
            ids = next(d.q_ids for d in drafts if d.q is not None)
            empty = logp.new_zeros(n - 1, ids.numel())  # greedy rows: never read (they keep exact matching)
            q = logp.new_zeros(count, n - 1, logp.shape[-1])
            q[..., ids] = torch.stack([d.q if d.q is not None else empty for d in drafts])
            new = rejection_draws(logp, w.tokens, q, seeds, at)
        else:
            tokens = torch.cat([w.tokens[:, :1], w.tokens], dim=1)  # node 0's token is never read
            new = multiround_draws(logp, tokens, w.parents, seeds, at, self.topk)
        draws[flat] = torch.where(rpw.temperature > 0, new.flatten(), draws[flat])
