// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) (+ residual[m, n]) for a few rows m: decode and verify steps.
//
// Why a kernel of our own: at 1..8 rows a linear layer is a read of its weights, and the rows are almost
// free if the weights are read once. MKL's sgemm reads 4 rows at half the bandwidth of one; oneDNN's
// packed kernel costs 1.33x one row at 4 rows (docs/benchmarks.md). Here every pair of weight rows is read
// from memory once and meets every input row from L1, so 4 rows cost about what 1 costs.
//
// Batch invariance, on purpose: y[m, n] is summed in the same order whatever the number of rows and
// wherever row m sits in its block (8 lanes over k, then a fixed horizontal sum), so a token's logits are
// bitwise the same in a 1-row decode step and in a verify window: speculation cannot flip a near-tie.
// The int8 variant (rows_linear_int8) reads weights stored as int8 with one fp32 scale per output row
// (the draft head, opt-in): a quarter of the bytes, widened to fp32 in registers, summed in the same
// fixed order, and scaled once per output: y[m, n] = scale[n] * sum_k q[n, k] x[m, k].
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// MB input rows against NW weight rows: NW*MB accumulators over k, 8 lanes each. NW weight rows stream
// from memory side by side (more loads in flight); each MB-row block after the first rereads them from L1.
template <int NW, int MB, typename W>
inline void block(const float* __restrict x, int64_t K, const W* __restrict w, float* __restrict out) {
  __m256 acc[NW][MB];
#pragma GCC unroll 16
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[i][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NW];
#pragma GCC unroll 16
    for (int i = 0; i < NW; ++i) {
      wv[i] = load8(w + i * K + k);
      if (sizeof(W) == 4 || (k & 63) == 0)  // fp32: every 8 floats; int8: once a 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NW + i) * K + k), _MM_HINT_T0);  // two groups ahead
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 16
      for (int i = 0; i < NW; ++i) acc[i][m] = _mm256_fmadd_ps(wv[i], xv, acc[i][m]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < NW; ++i) out[m * NW + i] = hsum(acc[i][m]);
}

// Every input row against NW weight rows, in blocks of 4 rows (then the 1-3 left).
template <int NW, typename W>
inline void rows_against(const float* x, int64_t M, const W* w, int64_t K, float* out /* [M][NW] */) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<NW, 4, W>(x + m * K, K, w, out + m * NW);
  switch (M - m) {
    case 3: block<NW, 3, W>(x + m * K, K, w, out + m * NW); break;
    case 2: block<NW, 2, W>(x + m * K, K, w, out + m * NW); break;
    case 1: block<NW, 1, W>(x + m * K, K, w, out + m * NW); break;
    default: break;
  }
}

// Output features [n, n + NW) for every row, with scale (int8 weights), bias and residual.
template <int NW, typename W>
inline void features(const float* x, int64_t M, const W* w, int64_t K, int64_t N, int64_t n, const float* scale,
                     const float* bias, const float* residual, float* y, float* out) {
  rows_against<NW, W>(x, M, w + n * K, K, out);
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < NW; ++i) {
      float v = out[m * NW + i];
      if (scale) v *= scale[n + i];
      if (bias) v += bias[n + i];
      if (residual) v += residual[m * N + n + i];
      y[m * N + n + i] = v;
    }
}

template <typename W>
at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const float* scale, const std::optional<at::Tensor>& bias,
               const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dtype() == at::kFloat, "rows_linear: float32 inputs only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rows_linear: contiguous inputs only");
  const int64_t K = weight.size(1), N = weight.size(0), M = x.numel() / K;
  TORCH_CHECK(K % 8 == 0 && x.size(-1) == K, "rows_linear: in_features must match and be a multiple of 8");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  const W* wp = weight.data_ptr<W>();
  TORCH_CHECK(!bias || (bias->numel() == N && bias->is_contiguous()), "rows_linear: bias shape");
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::Tensor res;  // held here: a temporary's pointer would dangle
  if (residual) {
    TORCH_CHECK(residual->numel() == M * N && residual->dtype() == at::kFloat, "rows_linear: residual shape");
    res = residual->contiguous();
  }
  const float* rp = residual ? res.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // 4 weight rows at a time for 1-2 input rows (their loop is short of independent FMAs), else 2
  const int64_t nw = M <= 2 ? 4 : 2;
  at::parallel_for(0, (N + nw - 1) / nw, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> out(M * 4);
    for (int64_t g = begin; g < end; ++g) {
      int64_t n = g * nw;
      const int64_t stop = std::min(n + nw, N);
      if (nw == 4 && n + 4 <= stop) {
        features<4, W>(xp, M, wp, K, N, n, scale, bp, rp, yp, out.data());
        n += 4;
      }
      for (; n + 2 <= stop; n += 2) features<2, W>(xp, M, wp, K, N, n, scale, bp, rp, yp, out.data());
      if (n < stop) features<1, W>(xp, M, wp, K, N, n, scale, bp, rp, yp, out.data());
    }
  });
  return y;
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(weight.dtype() == at::kFloat, "rows_linear: float32 weights only");
  return run<float>(x, weight, nullptr, bias, residual);
}

at::Tensor rows_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(weight.dtype() == at::kChar, "rows_linear_int8: int8 weights only");
  TORCH_CHECK(scale.dtype() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0),
              "rows_linear_int8: one float32 scale per output feature");
  return run<int8_t>(x, weight, scale.data_ptr<float>(), bias, residual);
}

}  // namespace

TORCH_LIBRARY(tsengine_cpu, lib) {
  lib.def("rows_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
  lib.def("rows_linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(tsengine_cpu, CPU, lib) {
  lib.impl("rows_linear", &rows_linear);
  lib.impl("rows_linear_int8", &rows_linear_int8);
}
