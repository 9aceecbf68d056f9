"""Sampling that does not depend on the batch or on speculation.

Every draw is Gumbel-max with noise keyed by (request seed, absolute position of the token being drawn,
vocab id): a counter-based hash, no generator state. The token a request gets at position p is therefore
the same whether it was decoded alone, in a batch of 16, as a verify row behind three drafts, or after a
preemption recomputed its prefix. Greedy is argmax with the lowest index on ties (torch.argmax's rule).

Filters (top-k, top-p, min-p) and temperature are applied per row from per-row tensors, so one call
samples a whole mixed batch; rows at temperature 0 take the plain argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tsengine.sampling_params import SamplingParams

M32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values (products masked back)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


_ID_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _id_hash(vocab: int, device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _ID_HASH:
        _ID_HASH[key] = _fmix32(torch.arange(vocab, dtype=torch.long, device=device) * 0x9E3779B1 & M32)
    return _ID_HASH[key]


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = 0) -> torch.Tensor:
    """[R] seeds, [R] positions -> [R, vocab] uniforms in (0, 1), a pure function of its arguments.
    `stream` separates independent noise for the same position (e.g. a drafter's own draws)."""
    s = seeds.long()
    key = _fmix32(_fmix32((s & M32) ^ 0x5BD1E995) ^ ((s >> 32) & M32) ^ (stream * 0x27D4EB2F & M32))
    row = _fmix32(key ^ (positions.long() & M32))
    h = _fmix32(row[:, None] ^ _id_hash(vocab, seeds.device)[None])
    return unit(h)


def unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in (0, 1): the top 23 bits plus one half, so the largest value is 1 - 2^-24,
    which float32 holds exactly (with 24 bits, k + 0.5 rounds to 2^24 and u = 1.0 makes Gumbel noise +inf:
    that id would win the argmax whatever its probability, filtered or not)."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def gumbel(seeds, positions, vocab: int, stream: int = 0) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seeds, positions, vocab, stream)))


@dataclass(kw_only=True)
class RowParams:
    """Per-row sampling tensors for one batch of logit rows (built once per step on the host)."""

    temperature: torch.Tensor  # [R] float; 0 = greedy
    top_k: torch.Tensor  # [R] long; 0 = off
    top_p: torch.Tensor  # [R] float
    min_p: torch.Tensor  # [R] float
    seeds: torch.Tensor  # [R] long
    all_greedy: bool
    any_filter: bool

    @staticmethod
    def build(params: list[SamplingParams], seeds: list[int], device) -> "RowParams":
        f = lambda xs, dt: torch.tensor(xs, dtype=dt).to(device, non_blocking=True)  # noqa: E731
        return RowParams(temperature=f([p.temperature for p in params], torch.float32),
                         top_k=f([p.top_k for p in params], torch.long),
                         top_p=f([p.top_p for p in params], torch.float32),
                         min_p=f([p.min_p for p in params], torch.float32), seeds=f(seeds, torch.long),
                         all_greedy=all(p.greedy for p in params),
                         any_filter=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params))

    def index(self, rows: torch.Tensor) -> "RowParams":
        return RowParams(temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
                         min_p=self.min_p[rows], seeds=self.seeds[rows], all_greedy=self.all_greedy,
                         any_filter=self.any_filter)


def filtered_logprobs(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """log softmax(logits / T) with top-k / top-p / min-p applied per row (removed ids get -inf)."""
    t = torch.where(rp.temperature > 0, rp.temperature, torch.ones_like(rp.temperature))
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    if not rp.any_filter:
        return logp
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None]
    drop = (rp.top_k[:, None] > 0) & (rank >= rp.top_k[:, None])
    probs = sorted_lp.exp()
    before = probs.cumsum(-1) - probs  # mass strictly above this token: keep while < top_p
    drop |= before >= rp.top_p[:, None]
    drop |= probs < rp.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the top token always survives
    return logp.scatter(-1, order, sorted_lp.masked_fill(drop, -math.inf))


def sample(logits: torch.Tensor, rp: RowParams, positions: torch.Tensor,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """[R, V] logits -> [R] token ids. `positions` [R]: the absolute position of the token drawn. `noise`:
    the rows' Gumbel noise when the caller already has it (it must equal gumbel(seeds, positions))."""
    greedy = logits.argmax(dim=-1)
    if rp.all_greedy:
        return greedy
    if noise is None:
        noise = gumbel(rp.seeds, positions, logits.shape[-1])
    drawn = (filtered_logprobs(logits, rp) + noise).argmax(dim=-1)
    return torch.where(rp.temperature > 0, drawn, greedy)
