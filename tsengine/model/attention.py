"""Paged attention: the torch reference backend and the dispatch to the Triton kernels.

Semantics every backend implements (and tests/model/test_triton_attention.py checks against a dense float64
loop): token t of request b at absolute position p attends to KV positions 0..p of request b; KV position j
lives in slot block_tables[b, j // block_size] * block_size + j % block_size. A verify window is therefore just a run of
consecutive positions, exactly like a prefill chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tsengine.model.context import Context

BACKENDS = ("torch", "triton")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> None:
    """Store this step's K/V ([T, nkv, d]) at their slots; caches are [num_blocks, block_size, nkv, d]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, v.to(v_cache.dtype))


def _dense_plan(ctx: Context, block_size: int, device, dtype):
    """Computed once per forward, shared by every layer: which cache slots to gather per request, where
    each token sits in the padded query block, and the position mask."""
    key = ("dense", block_size, dtype)
    if key not in ctx.memo:
        b = ctx.block_tables.shape[0]
        j = torch.arange(ctx.max_ctx, device=device)
        slots = (ctx.block_tables[:, j // block_size] * block_size + j % block_size).flatten()  # [B * ctx]
        local = torch.arange(ctx.num_tokens, device=device) - ctx.query_start[ctx.seq_index]
        if ctx.tree_anc is None:
            if ctx.uniform:
                qpos = ctx.positions.view(b, ctx.max_q)
            else:
                qpos = torch.zeros(b, ctx.max_q, dtype=torch.long, device=device)
                qpos[ctx.seq_index, local] = ctx.positions
            mask = (j[None, None] <= qpos[:, :, None]) & (j[None, None] < ctx.context_lens[:, None, None])
        else:  # below the window: all; inside: the token's bits (itself and its ancestors)
            rel = j[None] - ctx.tree_start[:, None]
            seen = (rel < 0) | ((rel < 64) & (((ctx.tree_anc[:, None] >> rel.clamp(0, 63)) & 1) == 1))
            seen &= j[None] < ctx.context_lens[ctx.seq_index][:, None]
            if ctx.uniform:
                mask = seen.view(b, ctx.max_q, ctx.max_ctx)
            else:
                mask = (j == 0)[None, None].expand(b, ctx.max_q, ctx.max_ctx).clone()  # padding rows see index 0
                mask[ctx.seq_index, local] = seen
        # Additive float mask, built once (SDPA would convert a bool mask in every layer). One request
        # decoding one token sees its whole gathered context: no mask at all.
        if b == 1 and ctx.max_q == 1 and ctx.exact_ctx:
            mask = None
        else:
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))[:, None]
        ctx.memo[key] = (slots, local, mask)
    return ctx.memo[key]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context,
                          scale: float) -> torch.Tensor:
    """q [T, nh, d] -> [T, nh, d]. Vectorized over requests: pad each request's queries to max_q and
    gather its KV to max_ctx, one SDPA call with a position mask, unpad. Padding query rows attend to
    position 0 (always valid), so no row is fully masked."""
    if ctx.groups is not None:  # decodes apart from long runs: nobody pads one token to a chunk's length
        out = torch.empty_like(q)
        for rows, sub in ctx.parts():
            out[rows] = paged_attention_torch(q.index_select(0, rows), k_cache, v_cache, sub, scale)
        return out
    slots, local, mask = _dense_plan(ctx, k_cache.shape[1], q.device, q.dtype)
    b = ctx.block_tables.shape[0]
    nkv, d = k_cache.shape[2:]
    gqa = nkv != q.shape[1]
    if ctx.dense_base is not None:
        # One request whose blocks are consecutive (the usual batch-1 case): its KV is a view of the cache
        # and its tokens need no padding. Fewest ops: on a small CPU each op's dispatch is a visible share of
        # a decode step (docs/benchmarks-journal.md, "Engine decode speed (issue 4)").
        span = slice(ctx.dense_base, ctx.dense_base + ctx.max_ctx)
        k, v = k_cache.view(-1, nkv, d)[span], v_cache.view(-1, nkv, d)[span]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)
    k = k_cache.view(-1, nkv, d).index_select(0, slots).view(b, ctx.max_ctx, nkv, d).to(q.dtype)
    v = v_cache.view(-1, nkv, d).index_select(0, slots).view(b, ctx.max_ctx, nkv, d).to(q.dtype)
    decode = ctx.max_q == 1 and b == ctx.num_tokens  # one token per request: nothing to pad
    if decode:
        qp = q[:, None]
    elif ctx.uniform:
        qp = q.view(b, ctx.max_q, *q.shape[1:])
    else:
        qp = q.new_zeros(b, ctx.max_q, *q.shape[1:])
        qp[ctx.seq_index, local] = q
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=gqa)
    o = o.transpose(1, 2)
    if decode or ctx.uniform:
        return o.reshape(q.shape)
    return o[ctx.seq_index, local]


def paged_attention(q, k_cache, v_cache, ctx: Context, scale: float, backend: str = "torch") -> torch.Tensor:
    if backend == "triton":
        from tsengine.model.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, ctx, scale)
    return paged_attention_torch(q, k_cache, v_cache, ctx, scale)
