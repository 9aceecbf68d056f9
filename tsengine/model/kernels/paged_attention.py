"""Paged attention in Triton: same semantics as `tsengine.model.attention.paged_attention_torch`.

Two kernels because the batch has two shapes of work. Decode tokens and short verify windows have a query or
a handful per request, so the work is one (token, kv head) program that reads its request's KV once for all
the query heads of the GQA group (the group rows fill the tensor-core M dimension that one query cannot).
Prefill chunks have many queries per request, so a program takes a tile of them and every KV tile it loads is
reused by all of its rows; that is what makes long chunks compute-bound instead of bandwidth-bound.

KV tiles are BLOCK_N keys gathered key by key through the block table (block = table[j // block_size],
offset j % block_size), not one cache block per iteration: the tile size is then a tuning knob independent
of the cache's block_size (1..16 tokens would make tl.dot tiles too small to use tensor cores), any power-of-two
block_size works unchanged, and the extra table loads are a few int64 reads per tile that stay in L1/L2.
block_size is a constexpr power of two, so the division and the modulo compile to a shift and a mask.

Softmax is online (flash-style) in fp32 with exp2 (the scale is folded with log2(e)); K/V are cast to q's dtype
before the dots, as the reference does. Padding rows (GQA group rows past the group, queries past a request's
run) read position 0 like the reference's padding, so no row is ever fully masked and nothing turns to NaN;
their output is never stored.

Tree windows (TREE): a token sees every key below its window's start and, inside the window (≤ 64 keys), the
keys whose bit is set in its int64 ancestor mask — the rule `tsengine.model.attention` states. A plain token in the
same batch carries start = its position and mask 1, so one predicate serves prefill chunks, tree windows and
draft lanes alike (a draft lane's KV index is not its RoPE position, so positions are never used for the
limit when TREE is on).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tsengine.model.context import Context

PREFILL_MIN_Q = 16  # ctx.max_q above this takes the prefill kernel (a host int: no device sync to decide)
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter (triton 3.9) multiplies bf16 as its raw uint16 bits; fp32 holds them exactly
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _kv_tile(k_ptr, v_ptr, table_ptr, j, jmask, d, dmask, kvh, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
             BLOCK_SIZE: tl.constexpr):
    """K and V of key positions `j` of one request (its block-table row at `table_ptr`), zero where masked."""
    blk = tl.load(table_ptr + j // BLOCK_SIZE, mask=jmask, other=0)
    off = j % BLOCK_SIZE
    kvmask = jmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + blk[:, None] * sk_b + off[:, None] * sk_s + kvh * sk_h + d[None, :], mask=kvmask, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * sv_b + off[:, None] * sv_s + kvh * sv_h + d[None, :], mask=kvmask, other=0.0)
    return k, v


@triton.jit
def _tree_visible(j, st, bits):
    """Key j visible to a token whose window starts at `st` with ancestor bits `bits` (broadcasting)."""
    rel = j - st
    return (rel < 0) | ((rel < 64) & (((bits >> tl.minimum(tl.maximum(rel, 0), 63)) & 1) == 1))


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax update (log2 domain) with scores `s` [rows, BLOCK_N] and values `v`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, start_ptr, anc_ptr, seq_ptr, bt_ptr, lens_ptr,
                   sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt, qk_scale,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   TREE: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(seq_ptr + t)
    if TREE:
        st = tl.load(start_ptr + t)
        bits = tl.load(anc_ptr + t)
        limit = tl.minimum(st + 64, tl.load(lens_ptr + b))
    else:
        limit = tl.minimum(tl.load(pos_ptr + t) + 1, tl.load(lens_ptr + b))

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, limit, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jmask = j < limit
        k, v = _kv_tile(k_ptr, v_ptr, bt_ptr + b * sbt, j, jmask, d, dmask, kvh, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                        BLOCK_SIZE)
        s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST) * qk_scale  # [BLOCK_G, BLOCK_N]
        if TREE:
            jmask = jmask & _tree_visible(j, st, bits)
        s = tl.where(jmask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v.to(q.dtype), m_i, l_i, acc, PRECISION, UPCAST)

    out = acc / l_i[:, None]
    tl.store(o_ptr + t * so_t + heads[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, start_ptr, anc_ptr, qstart_ptr, bt_ptr, lens_ptr,
                    sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, sbt, qk_scale,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr):
    """Rows are (query, group head) pairs, BLOCK_M queries x BLOCK_G heads, so one KV tile serves the whole
    GQA group as in the decode kernel. Positions are read per row rather than assumed consecutive."""
    b = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    kvh = tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    n_q = tl.load(qstart_ptr + b + 1) - q0
    if m_start >= n_q:
        return
    n_ctx = tl.load(lens_ptr + b)

    r = tl.arange(0, BLOCK_M * BLOCK_G)
    qi = m_start + r // BLOCK_G
    g = r % BLOCK_G
    rmask = (qi < n_q) & (g < GROUP)
    tok = q0 + qi
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + tok[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=qmask, other=0.0)
    qpos = tl.load(pos_ptr + tok, mask=rmask, other=0)
    if TREE:  # padding rows: window at 0 with only bit 0, i.e. they see key 0
        st = tl.load(start_ptr + tok, mask=rmask, other=0)
        bits = tl.load(anc_ptr + tok, mask=rmask, other=1)
        hi = tl.minimum(tl.max(st, 0) + 64, n_ctx)
    else:
        hi = tl.minimum(tl.max(qpos, 0) + 1, n_ctx)  # key tiles past the tile's last position are never loaded

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jmask = j < hi
        k, v = _kv_tile(k_ptr, v_ptr, bt_ptr + b * sbt, j, jmask, d, dmask, kvh, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                        BLOCK_SIZE)
        s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST) * qk_scale
        if TREE:
            seen = jmask[None, :] & _tree_visible(j[None, :], st[:, None], bits[:, None])
        else:
            seen = jmask[None, :] & (j[None, :] <= qpos[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v.to(q.dtype), m_i, l_i, acc, PRECISION, UPCAST)

    out = acc / l_i[:, None]
    tl.store(o_ptr + tok[:, None] * so_t + heads[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qmask)


def _common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float, block_n: int):
    """Shared launch arguments; the caches may be strided views, only their last dim must be dense."""
    nh, d = q.shape[1], q.shape[2]
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    assert nh % nkv == 0, f"{nh} query heads is not a multiple of {nkv} kv heads"
    assert bs & (bs - 1) == 0, f"block_size {bs} is not a power of two"
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "BLOCK_N must be a power of two >= 16 (tl.dot)"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = nh // nkv
    tree = ctx.tree_anc is not None
    for x in (ctx.positions, ctx.seq_index, ctx.context_lens, ctx.query_start, ctx.tree_start, ctx.tree_anc):
        assert x is None or x.is_contiguous(), "per-token index tensors are read as dense arrays"
    args = (q, k_cache, v_cache, out, ctx.positions, ctx.tree_start if tree else ctx.positions,
            ctx.tree_anc if tree else ctx.positions)
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0),
               out.stride(1), ctx.block_tables.stride(0), scale * LOG2E)
    meta = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=bs,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 must not silently drop to tf32
                UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1", TREE=tree)
    return out, nkv, group, args, strides, meta


def _decode(q, k_cache, v_cache, ctx: Context, scale: float, block_n: int = 64) -> torch.Tensor:
    out, nkv, group, args, strides, meta = _common(q, k_cache, v_cache, ctx, scale, block_n)
    if ctx.num_tokens:
        # tl.dot wants M >= 16: a small group is padded with zero rows (masked on store) rather than
        # falling back to a broadcast-and-sum that would leave the tensor cores idle.
        _decode_kernel[(ctx.num_tokens, nkv)](*args, ctx.seq_index, ctx.block_tables, ctx.context_lens, *strides,
                                               BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
                                               num_warps=4, **meta)
    return out


def _prefill(q, k_cache, v_cache, ctx: Context, scale: float, block_m: int | None = None,
             block_n: int = 64) -> torch.Tensor:
    """`block_m` counts queries; the tile has block_m * next_pow2(group) rows, 64 by default."""
    out, nkv, group, args, strides, meta = _common(q, k_cache, v_cache, ctx, scale, block_n)
    block_g = triton.next_power_of_2(group)
    block_m = block_m or max(1, 64 // block_g)
    assert block_m & (block_m - 1) == 0 and block_m * block_g >= 16, "tile rows must be a power of two >= 16"
    if ctx.num_tokens:
        grid = (ctx.block_tables.shape[0], math.ceil(ctx.max_q / block_m), nkv)
        _prefill_kernel[grid](*args, ctx.query_start, ctx.block_tables, ctx.context_lens, *strides,
                              BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, **meta)
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context,
                           scale: float, kernel: str | None = None) -> torch.Tensor:
    """q [T, nh, d] -> [T, nh, d] in q's dtype. `kernel` forces "decode" or "prefill"; by default a batch
    with a run longer than PREFILL_MIN_Q takes the prefill kernel (decode would re-read that run's KV once per
    token), otherwise the decode kernel (its grid covers every token even when runs are uneven)."""
    if kernel is None:
        kernel = "prefill" if ctx.max_q > PREFILL_MIN_Q else "decode"
    if kernel == "prefill":
        return _prefill(q, k_cache, v_cache, ctx, scale)
    if kernel == "decode":
        return _decode(q, k_cache, v_cache, ctx, scale)
    raise ValueError(f"unknown kernel {kernel!r}: expected 'decode' or 'prefill'")
