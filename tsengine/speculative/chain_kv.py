"""The greedy chain's own keys, kept beside the draft cache instead of written into it.

Why: a chain step at draft position p + s needs the head's KV at positions 0..p (the paged draft cache, which
the extension has just written) and at p + 1..p + s (the chain's earlier steps). Those later keys are never
read again: the next extension rewrites positions from p + 1 on with the committed tokens' rows, and a
request's `draft_cached` never counts them. So the chain keeps them as tensors of its own. That is what
lets one compiled graph run the extension and the whole chain: a graph that writes the cache more than once
makes inductor copy the whole cache (several times what the same head steps cost as graphs of their own;
measured: docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"), one write stays in place. The
past is gathered once per chain, not once per step.

Semantics (the same as `attention.paged_attention` over the cache written step by step): the query of step
s attends to cache positions 0..p of its request and to the chain's keys 1..s. Torch SDPA on every backend:
the Triton paged kernels are for the cache, and a chain's few keys need no paging. The past is gathered
densely ([D, table width · block size] per layer pass): unmeasured on a GPU, where a long context would
make that gather the chain's largest cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ChainKV:
    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor,
                 block_size: int, dtype: torch.dtype):
        """The past of D requests: block tables `tables` [D, M] over caches [blocks, block_size, nkv, d],
        each request's last cached position `pos` [D]; attention runs in `dtype`."""
        width = tables.shape[1]
        j = torch.arange(width * block_size, device=tables.device)
        slots = tables[:, j // block_size] * block_size + j % block_size  # [D, C]
        nkv, hd = k_cache.shape[2:]
        self.k = k_cache.view(-1, nkv, hd)[slots].to(dtype).transpose(1, 2)  # [D, nkv, C, d]
        self.v = v_cache.view(-1, nkv, hd)[slots].to(dtype).transpose(1, 2)
        visible = j[None] <= pos[:, None]
        self.mask = torch.zeros(visible.shape, dtype=dtype, device=tables.device).masked_fill_(~visible, float("-inf"))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One step: q [D, nh, d] and this step's k/v [D, nkv, d] (kept for the steps after) -> [D, nh, d]."""
        self.k = torch.cat([self.k, k[:, :, None].to(self.k.dtype)], dim=2)
        self.v = torch.cat([self.v, v[:, :, None].to(self.v.dtype)], dim=2)
        self.mask = torch.cat([self.mask, self.mask.new_zeros(self.mask.shape[0], 1)], dim=1)
        o = F.scaled_dot_product_attention(q[:, :, None], self.k, self.v, attn_mask=self.mask[:, None, None],
                                           scale=scale, enable_gqa=self.k.shape[1] != q.shape[1])
        return o[:, :, 0]
