"""The two verification rules at temperature > 0 that keep the target's distribution without reproducing
plain sampling's seeded tokens: rejection sampling for a chain, the point-mass multi-round rule for a tree.

Both are written as "the draw each node makes", the same currency as the default Gumbel rule: a node's
draw is the child it accepts or, when it accepts none, a sample from what is left of p. The engine's one
acceptance rule (a node is accepted when its token is its parent's draw and its parent is accepted) then
walks the path unchanged. Rejected children can never equal the residual draw: a rejected x has
p(x) ≤ q(x), so the residual gives it zero mass (chain), or x was removed from p (multi-round).

All randomness is keyed like `tsengine.sampling`: (request seed, draw position, stream). Stream 0 is plain
sampling's, 1 the drafter's own samples, 2 the acceptance uniforms, 3 and 4 the residual draws.
Comparisons of a uniform against a probability run in float64, where u·r(x) < r(x) holds exactly for
u < 1 (in float32 the product can round up to r(x) and reject a child that holds all remaining mass). The noise a
node uses at one position is shared by nodes of the same depth in other subtrees; only one of them is ever
on the accepted path, so the draws along the path stay independent.
"""

from __future__ import annotations

import torch

from tsengine.sampling import uniform

ACCEPT, RESIDUAL, RESIDUAL_LO = 2, 3, 4  # noise streams


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
    last = v - 1 - (dist.flip(-1) > 0).int().argmax(-1, keepdim=True)  # u rounded up to the total: the last id with mass
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
