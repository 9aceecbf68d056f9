"""The few-row matmul kernel (tsengine/model/kernels/rows_linear.cpp): right, batch-invariant, and what Linear uses."""

import pytest
import torch
import torch.nn.functional as F

from tsengine.model.kernels import rows_linear
from tsengine.model.linear import Linear

pytestmark = pytest.mark.skipif(not rows_linear.available(), reason="needs g++ and an AVX2/FMA CPU")


def _rows(x, w, bias=None, residual=None):
    return rows_linear.rows_linear(x, rows_linear.panels(w), w.shape[0], bias, residual)


def _rows_int8(x, q, scale, bias=None, residual=None):
    return rows_linear.rows_linear_int8(x, rows_linear.panels(q), scale, bias, residual)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("out_features", [1, 2, 7, 96, 130])
@pytest.mark.parametrize("in_features", [64, 301])  # 301: k in tiles of 128 above 4 rows, with a ragged end
def test_matches_f_linear_with_bias_and_residual(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    b, r = torch.randn(out_features, generator=g), torch.randn(rows, out_features, generator=g)
    tol = {"rtol": 1e-5, "atol": 1e-4}  # one sequential fp32 sum over k: error grows with in_features
    torch.testing.assert_close(_rows(x, w), F.linear(x, w), **tol)
    torch.testing.assert_close(_rows(x, w, b, r), r + F.linear(x, w, b), **tol)


def test_a_row_is_the_same_bits_in_any_batch():
    """Why the kernel sums in a fixed order: a token verified in a window of 16 rows gets the logits it
    would get decoded alone, so speculation cannot flip a near-tie that plain decoding resolves."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 576, generator=g), torch.randn(1539, 576, generator=g)
    full = _rows(x, w)
    for rows in (1, 2, 3, 5, 16):
        for start in range(0, 16 - rows + 1, rows):
            assert torch.equal(_rows(x[start:start + rows], w), full[start:start + rows])


def test_no_rows_give_no_rows():
    w = torch.randn(40, 64)
    assert _rows(torch.randn(0, 64), w).shape == (0, 40)
    assert _rows_int8(torch.randn(2, 0, 64), w.to(torch.int8), torch.ones(40)).shape == (2, 0, 40)


def test_leading_dims_are_kept():
    x, w = torch.randn(2, 3, 64), torch.randn(40, 64)
    y = _rows(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_linear_takes_the_kernel_for_few_rows_only(monkeypatch):
    calls = []
    real = rows_linear.rows_linear
    monkeypatch.setattr(rows_linear, "rows_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    w, b = torch.randn(48, 64), torch.randn(48)
    lin = Linear(w, b)
    few, many = torch.randn(rows_linear.MAX_ROWS, 64), torch.randn(rows_linear.MAX_ROWS + 1, 64)
    torch.testing.assert_close(lin(few), F.linear(few, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(many), F.linear(many, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.add(few, few[:, :48]), few[:, :48] + F.linear(few, w, b), rtol=1e-5, atol=1e-5)
    assert calls == [few.shape, few.shape]


def test_compiled_graph_calls_the_kernel():
    """Inside torch.compile (inductor, C++ wrapper as the engine's graphs use) the op is an extern call."""
    w, b = torch.randn(48, 64), torch.randn(48)
    lin = Linear(w, b)

    def step(x, r):
        return lin.add(x, r)

    x, r = torch.randn(4, 64), torch.randn(4, 48)
    with torch.no_grad():
        got = torch.compile(step, fullgraph=True, options={"cpp_wrapper": True})(x, r)
    torch.testing.assert_close(got, r + F.linear(x, w, b), rtol=1e-5, atol=1e-5)


# ---- int8 weights (the draft head's --speculative-draft-model-quantization int8) ------------------------------
def _int8(out_features: int, in_features: int, seed: int):
    from tsengine.model.linear import quantize_int8

    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_int8(w)
    return w, q, scale, q.float() * scale[:, None]


def test_int8_quantization_is_per_row_and_within_half_a_step():
    w, q, scale, deq = _int8(96, 64, 0)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the whole range
    assert ((w - deq).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("out_features", [1, 7, 96, 130])
@pytest.mark.parametrize("in_features", [64, 301])
def test_int8_matches_f_linear_on_the_dequantized_weights(rows, out_features, in_features):
    _, q, scale, deq = _int8(out_features, in_features, rows * 1000 + out_features)
    g = torch.Generator().manual_seed(rows)
    x, b, r = (torch.randn(rows, in_features, generator=g), torch.randn(out_features, generator=g),
               torch.randn(rows, out_features, generator=g))
    tol = {"rtol": 1e-5, "atol": 1e-4}  # one sequential fp32 sum over k
    torch.testing.assert_close(_rows_int8(x, q, scale), F.linear(x, deq), **tol)
    torch.testing.assert_close(_rows_int8(x, q, scale, b, r), r + F.linear(x, deq, b), **tol)


def test_int8_rows_are_the_same_bits_in_any_batch():
    _, q, scale, _ = _int8(1539, 576, 1)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(2))
    full = _rows_int8(x, q, scale)
    for rows in (1, 2, 3, 5, 16):
        for start in range(0, 16 - rows + 1, rows):
            assert torch.equal(_rows_int8(x[start:start + rows], q, scale), full[start:start + rows])


@torch.no_grad()
def test_accelerate_int8_makes_the_module_the_int8_model_on_every_path(monkeypatch):
    """Few rows read the int8 weights; more rows (prefill) and anything reading the parameters see their
    dequantized values: one model, whatever the batch."""
    from torch import nn

    from tsengine.model.linear import accelerate

    calls = []
    real = rows_linear.rows_linear_int8
    monkeypatch.setattr(rows_linear, "rows_linear_int8", lambda *a: calls.append(a[0].shape) or real(*a))
    lin = nn.Linear(64, 48)
    original = lin.weight.clone()
    accelerate(lin, "int8")
    q, scale = lin.forward.qweight, lin.forward.scale
    deq = q.float() * scale[:, None]
    assert torch.equal(lin.weight, deq) and not torch.equal(lin.weight, original)
    few, many = torch.randn(rows_linear.MAX_ROWS, 64), torch.randn(rows_linear.MAX_ROWS + 1, 64)
    torch.testing.assert_close(lin(few), F.linear(few, deq, lin.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(many), F.linear(many, deq, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [few.shape]
    with pytest.raises(ValueError, match="allowed: none, bf16, int8"):
        accelerate(nn.Linear(8, 8), "int4")


def test_compiled_graph_calls_the_int8_kernel():
    from torch import nn

    from tsengine.model.linear import accelerate

    lin = accelerate(nn.Linear(64, 48), "int8")
    x, r = torch.randn(4, 64), torch.randn(4, 48)
    step = torch.compile(lambda x, r: lin.forward.add(x, r), fullgraph=True, options={"cpp_wrapper": True})
    with torch.no_grad():
        step(x, r)
        with torch.profiler.profile() as prof:
            got = step(x, r)
    torch.testing.assert_close(got, r + F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert "tsengine_cpu::rows_linear_int8" in {e.name for e in prof.events()}


# ---- bf16 weights (the draft head's --speculative-draft-model-quantization bf16) ------------------------------
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("out_features", [7, 130])
def test_bf16_panels_give_the_bits_of_fp32_panels_of_the_rounded_weights(rows, out_features):
    """bf16 is a storage format here, not arithmetic: widened in registers, summed as fp32."""
    from tsengine.model.linear import round_bf16

    g = torch.Generator().manual_seed(rows * 100 + out_features)
    x, w = torch.randn(rows, 301, generator=g), torch.randn(out_features, 301, generator=g)
    b, r = torch.randn(out_features, generator=g), torch.randn(rows, out_features, generator=g)
    low = round_bf16(w)
    assert low.dtype == torch.bfloat16 and not torch.equal(low.float(), w)
    got = rows_linear.rows_linear(x, rows_linear.panels(low), out_features, b, r)
    assert torch.equal(got, _rows(x, low.float(), b, r))
    torch.testing.assert_close(got, r + F.linear(x, low.float(), b), rtol=1e-5, atol=1e-4)


def test_bf16_rows_are_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(2)
    x, low = torch.randn(16, 576, generator=g), torch.randn(1539, 576, generator=g).bfloat16()
    full = rows_linear.rows_linear(x, rows_linear.panels(low), 1539)
    for rows in (1, 2, 3, 5, 16):
        for start in range(0, 16 - rows + 1, rows):
            got = rows_linear.rows_linear(x[start:start + rows], rows_linear.panels(low), 1539)
            assert torch.equal(got, full[start:start + rows])


@torch.no_grad()
def test_accelerate_bf16_makes_the_module_the_rounded_model_on_every_path(monkeypatch):
    """Few rows read the bf16 panels (half the bytes); more rows (prefill) and the parameters hold the
    same rounded values in fp32."""
    from torch import nn

    from tsengine.model.linear import accelerate

    lin = nn.Linear(64, 48)
    original = lin.weight.clone()
    accelerate(lin, "bf16")
    rounded = original.bfloat16().float()
    assert torch.equal(lin.weight, rounded) and not torch.equal(rounded, original)
    assert lin.forward.panels.dtype == torch.bfloat16 and lin.forward.scale is None
    few, many = torch.randn(rows_linear.MAX_ROWS, 64), torch.randn(rows_linear.MAX_ROWS + 1, 64)
    want = _rows(few, rounded, lin.bias)
    calls = []
    real = rows_linear.rows_linear
    monkeypatch.setattr(rows_linear, "rows_linear", lambda *a: calls.append(a[1].dtype) or real(*a))
    assert torch.equal(lin(few), want)
    torch.testing.assert_close(lin(many), F.linear(many, rounded, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [torch.bfloat16]


def test_compiled_graph_calls_the_kernel_on_bf16_panels():
    from torch import nn

    from tsengine.model.linear import accelerate

    lin = accelerate(nn.Linear(64, 48), "bf16")
    x, r = torch.randn(4, 64), torch.randn(4, 48)
    step = torch.compile(lambda x, r: lin.forward.add(x, r), fullgraph=True, options={"cpp_wrapper": True})
    with torch.no_grad():
        step(x, r)
        got = step(x, r)
    assert torch.equal(got, _rows(x, lin.weight, lin.bias, r))


@torch.no_grad()
def test_weights_that_are_bf16_values_are_read_as_bf16_to_the_same_bits():
    """A bf16 checkpoint loaded into an fp32 engine: half the bytes, nothing else changes."""
    g = torch.Generator().manual_seed(5)
    exact, fp32 = torch.randn(48, 64, generator=g).bfloat16().float(), torch.randn(48, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    for w, stored in ((exact, torch.bfloat16), (fp32, torch.float32)):
        lin = Linear(w)
        assert lin.panels.dtype == stored and torch.equal(lin.weight, w)
        assert torch.equal(lin(x), _rows(x, w))


@torch.no_grad()
def test_projections_fused_from_bf16_and_fp32_weights_run_on_fp32_panels():
    """One fused matmul over a bf16-exact and an fp32 projection (a partly rounded checkpoint) keeps each
    one's values: the stacked copy is fp32, never a concatenation of mismatched stored copies."""
    from tsengine.model.linear import _stacked

    g = torch.Generator().manual_seed(6)
    exact, fp32 = torch.randn(32, 64, generator=g).bfloat16().float(), torch.randn(16, 64, generator=g)
    x = torch.randn(2, 64, generator=g)
    fused = _stacked([Linear(exact), Linear(fp32)])
    assert fused.panels.dtype == torch.float32
    assert torch.equal(fused(x), _rows(x, torch.cat([exact, fp32])))
    both = _stacked([Linear(exact), Linear(exact)])
    assert both.panels.dtype == torch.bfloat16 and torch.equal(both(x), _rows(x, torch.cat([exact, exact])))


@pytest.mark.skipif(not (rows_linear.available() and rows_linear.avx512()), reason="needs an AVX-512F CPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_avx512_tile_gives_the_avx2_tiles_bits(dtype):
    """The AVX-512 tile (3+ rows, and a last odd panel) sums each output in the AVX2 tile's order: the same
    bits, so which one a CPU runs can never change a token."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(130, 301, generator=g)
    if dtype == "int8":
        from tsengine.model.linear import quantize_int8

        q, scale = quantize_int8(w)
        run = lambda x: rows_linear.rows_linear_int8(x, rows_linear.panels(q), scale)  # noqa: E731
    else:
        p = rows_linear.panels(w.to(torch.bfloat16) if dtype == "bf16" else w)
        run = lambda x: rows_linear.rows_linear(x, p, 130)  # noqa: E731
    for rows in (1, 2, 3, 4, 5, 8):
        x = torch.randn(rows, 301, generator=g)
        try:
            rows_linear.avx512(False)
            assert not rows_linear.avx512()
            avx2 = run(x)
        finally:
            rows_linear.avx512(True)
        assert torch.equal(run(x), avx2), rows
