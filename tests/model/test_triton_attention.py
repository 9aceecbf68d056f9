"""The Triton paged-attention kernels against the torch reference and a dense per-request loop.

Runs on CPU through the Triton interpreter (TRITON_INTERPRET must be set before the kernels are defined), so
shapes stay tiny; tiles are shrunk (block_n=16, block_m=8) so that short contexts still span several KV tiles
and several query tiles, which is where online softmax and tile skipping can go wrong.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (conftest sets it too)

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: the triton attention backend cannot run")

from tests.oracles import dense_attention  # noqa: E402
from tsengine.model.attention import paged_attention, paged_attention_torch, write_kv  # noqa: E402
from tsengine.model.context import Context  # noqa: E402
from tsengine.model.kernels.paged_attention import _decode, _prefill, paged_attention_triton  # noqa: E402

GARBAGE = 3e4  # finite in fp16/bf16, but any unmasked garbage key or value would blow the output up

# A mixed step: a 20-token prefill chunk resuming at position 9, a verify window of 4, decode tokens (one at
# position 0, whose only key is itself).
MIXED = [(9, 20), (17, 4), (0, 1), (13, 1), (30, 1)]


def make_batch(specs, block_size, nh, nkv, d, dtype, seed=0, spare_blocks=3):
    """Random q and caches for `specs` = [(first new position, new tokens)] with shuffled, disjoint block
    tables. Every slot that holds no KV of its request (unused blocks, tails past context_lens) is garbage."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(start + n) // block_size) for start, n in specs]
    perm = torch.randperm(sum(need) + spare_blocks, generator=g).tolist()
    runs, at = [], 0
    for (start, n), m in zip(specs, need):
        runs.append((perm[at: at + m], start, n))
        at += m
    ctx = Context.build(runs, block_size, "cpu")
    shape = (len(perm), block_size, nkv, d)
    k_cache = torch.full(shape, GARBAGE, dtype=dtype)
    v_cache = torch.full(shape, -GARBAGE, dtype=dtype)
    # write_kv with a context covering every position 0..len-1 fills exactly the valid slots
    full = Context.build([(bt, 0, start + n) for bt, start, n in runs], block_size, "cpu")
    write_kv(k_cache, v_cache, torch.randn(full.num_tokens, nkv, d, generator=g),
             torch.randn(full.num_tokens, nkv, d, generator=g), full)
    q = torch.randn(ctx.num_tokens, nh, d, generator=g).to(dtype)
    return q, k_cache, v_cache, ctx


def run(kernel, q, k_cache, v_cache, ctx, scale):
    if kernel == "decode":
        return _decode(q, k_cache, v_cache, ctx, scale, block_n=16)
    return _prefill(q, k_cache, v_cache, ctx, scale, block_m=8, block_n=16)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_mixed_batch_fp32_matches_reference_and_dense_loop(kernel):
    q, k_cache, v_cache, ctx = make_batch(MIXED, block_size=4, nh=4, nkv=2, d=16, dtype=torch.float32)
    scale = 16 ** -0.5
    out = run(kernel, q, k_cache, v_cache, ctx, scale)
    ref = paged_attention_torch(q, k_cache, v_cache, ctx, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(q, k_cache, v_cache, ctx, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_head_dim_and_group_not_powers_of_two(kernel):
    # head_dim 24 pads to 32, a GQA group of 3 pads to 4 (prefill) / 16 (decode) rows
    specs = [(5, 18), (40, 3), (2, 1)]
    q, k_cache, v_cache, ctx = make_batch(specs, block_size=16, nh=6, nkv=2, d=24, dtype=torch.float32, seed=1)
    out = run(kernel, q, k_cache, v_cache, ctx, 0.3)
    torch.testing.assert_close(out, paged_attention_torch(q, k_cache, v_cache, ctx, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_half_precision(kernel, dtype):
    q, k_cache, v_cache, ctx = make_batch(MIXED, block_size=4, nh=4, nkv=2, d=32, dtype=dtype, seed=2)
    out = run(kernel, q, k_cache, v_cache, ctx, 32 ** -0.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = dense_attention(q, k_cache, v_cache, ctx, 32 ** -0.5)
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_other_block_sizes(block_size):
    specs = [(3, 17), (11, 2)]
    q, k_cache, v_cache, ctx = make_batch(specs, block_size=block_size, nh=2, nkv=1, d=16, dtype=torch.float32,
                                          seed=3)
    ref = paged_attention_torch(q, k_cache, v_cache, ctx, 0.25)
    for kernel in ("decode", "prefill"):
        torch.testing.assert_close(run(kernel, q, k_cache, v_cache, ctx, 0.25), ref, atol=1e-5, rtol=1e-5)


def test_dispatch_and_public_entry_points():
    """Default dispatch (and the backend switch in tsengine.model.attention) with the default tile sizes, on a
    prefill-sized batch and a decode/verify-only one; q is a strided view, as after a fused QKV split."""
    for specs, seed in ((MIXED, 4), ([(6, 4), (0, 1), (21, 2)], 5)):
        q, k_cache, v_cache, ctx = make_batch(specs, block_size=4, nh=4, nkv=2, d=16, dtype=torch.float32, seed=seed)
        q = torch.cat([q, torch.randn_like(q)], dim=1)[:, :4]
        assert not q.is_contiguous()
        ref = paged_attention_torch(q, k_cache, v_cache, ctx, 0.25)
        torch.testing.assert_close(paged_attention_triton(q, k_cache, v_cache, ctx, 0.25), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(paged_attention(q, k_cache, v_cache, ctx, 0.25, backend="triton"), ref,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        paged_attention_triton(q, k_cache, v_cache, ctx, 0.25, kernel="flash")


@pytest.mark.parametrize("specs", [MIXED, [(13, 1)], [(0, 1)], [(5, 20)], [(3, 1), (40, 1)]], ids=str)
def test_torch_backend_matches_dense_loop(specs):
    """The reference backend itself, including its shortcuts: one request decoding one token (no mask),
    and device-built one-token contexts whose max_ctx is only an upper bound (the draft chain's)."""
    q, k_cache, v_cache, ctx = make_batch(specs, 4, 4, 2, 16, torch.float32, seed=5)
    out = paged_attention_torch(q, k_cache, v_cache, ctx, 0.25)
    torch.testing.assert_close(out.double(), dense_attention(q, k_cache, v_cache, ctx, 0.25), atol=1e-5, rtol=1e-5)
    if ctx.max_q == 1:
        chain = Context.one_each(ctx.block_tables, ctx.positions, 4)  # same tokens, loose max_ctx
        assert chain.max_ctx >= ctx.max_ctx and not chain.exact_ctx
        out = paged_attention_torch(q, k_cache, v_cache, chain, 0.25)
        torch.testing.assert_close(out.double(), dense_attention(q, k_cache, v_cache, ctx, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start, n", [(5, 3), (11, 1), (0, 7)])
def test_torch_backend_consecutive_blocks_view(start, n):
    """One request on consecutive blocks reads its KV as a view of the cache (no gather): same result."""
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(8, 4, 2, 16, generator=g), torch.randn(8, 4, 2, 16, generator=g)
    table = [2, 3, 4, 5]
    ctx = Context.build([(table, start, n)], 4, "cpu")
    assert ctx.dense_base == 8
    q = torch.randn(n, 4, 16, generator=g)
    out = paged_attention_torch(q, k_cache, v_cache, ctx, 0.25)
    torch.testing.assert_close(out.double(), dense_attention(q, k_cache, v_cache, ctx, 0.25), atol=1e-5, rtol=1e-5)
    assert Context.build([([2, 4, 5], start, n)], 4, "cpu").dense_base is None
