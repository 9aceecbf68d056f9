"""Training-time test (EAGLE-3): unroll the head on its own outputs, all positions of a batch at once.

At inference the head drafts a chain: step 0 reads the target's features of token t (fused by fc) and
token t+1; step k reads its own pre-norm output of step k-1 and the (teacher-forced) token t+1+k, at RoPE
position t+k, attending to the step-0 keys of positions 0..t (the committed prefix) and to its own keys
of steps 1..k at the same base t (its ancestors in the chain). Training reproduces exactly that for every
base t in parallel: the keys of step j are one [T] block, and the mask over [step 0 | step 1 | ... | k]
is [causal | identity | ... | identity]. One SDPA call per step; `naive_unroll` (a per-position loop over
the head's dense chain forward, i.e. the reference drafter's semantics) is the test oracle, in tests/oracles.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsengine.eagle3.head import Eagle3Head


def shift(x: torch.Tensor, k: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + k] along dim 1, `fill` past the end."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1) if k < x.shape[1] else torch.full_like(x, fill)


def ttt_mask(t: int, k: int, device) -> torch.Tensor:
    """Boolean [T, (k+1)·T]: causal over step-0 keys, then the diagonal of each later step."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * k, dim=1)


def unroll(head: Eagle3Head, embed: torch.Tensor, hidden0: torch.Tensor, input_ids: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """Pre-norm outputs of steps 0..steps-1, each [B, T, H].

    `hidden0` = head.project(aux) at every position t; `input_ids` [B, T] the sequence; `embed` the
    target's (frozen) embedding matrix. Step k at base t consumes token t+1+k (0 past the end: those
    positions are masked out of the loss)."""
    b, t, _ = hidden0.shape
    positions = torch.arange(t, device=hidden0.device).expand(b, t)
    keys, values, outs = [], [], []
    hidden = hidden0
    for k in range(steps):
        emb = F.embedding(shift(input_ids, k + 1), embed).to(hidden.dtype)
        cos, sin = head.rope(positions + k, hidden)
        q, kk, v = head.midlayer.qkv(emb, hidden, cos, sin)
        keys.append(kk)
        values.append(v)
        mask = ttt_mask(t, k, hidden.device)[None, None]
        o = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                           enable_gqa=kk.shape[1] != q.shape[1])
        hidden = head.finish(o, hidden)
        outs.append(hidden)
    return outs
