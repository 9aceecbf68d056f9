// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) (+ residual[m, n]) for a few rows m: decode and verify steps.
//
// Why a kernel of our own: at 1..8 rows a linear layer is a read of its weights, and the rows are almost
// free if the weights are read once, at the memory's speed. MKL's sgemm reads 4 rows at half the bandwidth
// of one; oneDNN's packed kernel is faster at 4 rows than at 1 and sums differently for each row count
// (docs/benchmarks-journal.md, "Compiled step graphs (issue 16)"). Here the weights are stored once in
// panels of 16 output features, k-major ([N/16][K][16], `panels()` in rows_linear.py), so each thread
// streams one contiguous region: at every k one 64-byte line of weights meets every input row (a
// broadcast from L1) in 16 lanes, one per output.
//
// Batch invariance, on purpose: y[m, n] is one lane's sum over k in order 0..K-1 (one FMA a step), whatever
// the number of rows, wherever row m sits and however rows are blocked, so a token's logits are bitwise
// the same in a 1-row decode step and in a verify window: speculation cannot flip a near-tie.
// Fewer bytes for the draft head (opt-in, --speculative-draft-model-quantization):
// - bf16 panels hold the weights rounded to bfloat16, widened to fp32 in registers (a 16-bit shift, no
//   bf16 units needed) and summed in the same order: the bits of the fp32 panels of the rounded weights,
//   from half the bytes;
// - int8 panels hold them as int8 with one fp32 scale per output feature: a quarter of the bytes, widened
//   the same way, scaled once per output: y[m, n] = scale[n] * sum_k q[n, k] x[m, k].
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

constexpr int64_t P = 16;            // output features per panel: two 8-lane registers
constexpr int64_t AHEAD = 2048;      // bytes of a panel prefetched ahead of the loads (1-4 KB measured alike)
constexpr int64_t K_TILE = 32;       // above 4 rows: k in tiles of 2 KB of a panel, reread from L1 (32 measured best)

inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {  // bf16: the high half of an fp32
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

inline void load16(const int8_t* p, __m256& lo, __m256& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

// MB input rows (row stride K) against NP adjacent panels, over k in [k0, k1), adding to acc
// ([MB][NP * P] floats, in memory between tiles: storing an fp32 sum and loading it back is exact).
template <int NP, int MB, typename W>
inline void tile(const float* __restrict x, int64_t K, int64_t k0, int64_t k1, const W* __restrict w,
                 int64_t panel_stride, float* __restrict acc) {
  __m256 a[MB][2 * NP];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < 2 * NP; ++i) a[m][i] = _mm256_loadu_ps(acc + m * NP * P + i * 8);
  for (int64_t k = k0; k < k1; ++k) {
    __m256 wv[2 * NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const W* wk = w + p * panel_stride + k * P;
      load16(wk, wv[2 * p], wv[2 * p + 1]);
      if (k % (4 / sizeof(W)) == 0)  // a 64-byte line every k (fp32), every 2nd (bf16), every 4th (int8)
        _mm_prefetch(reinterpret_cast<const char*>(wk) + AHEAD, _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 16
      for (int i = 0; i < 2 * NP; ++i) a[m][i] = _mm256_fmadd_ps(wv[i], xv, a[m][i]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < 2 * NP; ++i) _mm256_storeu_ps(acc + m * NP * P + i * 8, a[m][i]);
}

// The same tile in 16-lane AVX-512 registers, one per panel: half the FMAs and broadcasts of the AVX2 tile per
// weight line, and 3-4 rows take two panels a pass, so each row's broadcast serves both. On an AVX-512 Xeon
// this is what brings a 4-row verify window near a 1-row step (docs/benchmarks.md, "Few-row kernel and the
// 4-row verify step"). Lane j of panel p still sums its k in order with one FMA a step, so the result is the
// AVX2 tile's, bit for bit (tests/model/test_rows_linear.py compares the two). Compiled for AVX-512F here
// only; called only where the CPU reports it (`use_avx512`).
#pragma GCC push_options
#pragma GCC target("avx512f")
inline __m512 load16x(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16x(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512 load16x(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int NP, int MB, typename W>
__attribute__((noinline)) void tile512(const float* __restrict x, int64_t K, int64_t k0, int64_t k1,
                                       const W* __restrict w, int64_t panel_stride, float* __restrict acc) {
  __m512 a[MB][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) a[m][p] = _mm512_loadu_ps(acc + (m * NP + p) * P);
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const W* wk = w + p * panel_stride + k * P;
      wv[p] = load16x(wk);
      if (k % (4 / sizeof(W)) == 0) _mm_prefetch(reinterpret_cast<const char*>(wk) + AHEAD, _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) a[m][p] = _mm512_fmadd_ps(wv[p], xv, a[m][p]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(acc + (m * NP + p) * P, a[m][p]);
}
#pragma GCC pop_options

bool use_avx512 = __builtin_cpu_supports("avx512f");

template <int NP, typename W>
inline void block(const float* x, int64_t mb, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t stride,
                  float* acc) {
  if (NP == 1 && use_avx512) {
    switch (mb) {
      case 1: tile512<1, 1, W>(x, K, k0, k1, w, stride, acc); return;
      case 2: tile512<1, 2, W>(x, K, k0, k1, w, stride, acc); return;
      case 3: tile512<1, 3, W>(x, K, k0, k1, w, stride, acc); return;
      default: tile512<1, 4, W>(x, K, k0, k1, w, stride, acc); return;
    }
  }
  switch (mb) {
    case 1: tile<NP, 1, W>(x, K, k0, k1, w, stride, acc); break;
    case 2: tile<NP, 2, W>(x, K, k0, k1, w, stride, acc); break;
    case 3: tile<NP, 3, W>(x, K, k0, k1, w, stride, acc); break;
    default: tile<NP, 4, W>(x, K, k0, k1, w, stride, acc); break;
  }
}

template <typename W>
at::Tensor run(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* scale,
               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dtype() == at::kFloat, "rows_linear: float32 inputs only");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous(), "rows_linear: contiguous inputs only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == P && panels.size(0) == (N + P - 1) / P,
              "rows_linear: weights must be panels of 16 outputs (rows_linear.panels)");
  const int64_t K = panels.size(1), n_panels = panels.size(0), M = x.numel() / K;
  TORCH_CHECK(x.size(-1) == K, "rows_linear: in_features must match the weights'");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  TORCH_CHECK(!bias || (bias->numel() == N && bias->is_contiguous()), "rows_linear: bias shape");
  at::Tensor res;  // held here: a temporary's pointer would dangle
  if (residual) {
    TORCH_CHECK(residual->numel() == M * N && residual->dtype() == at::kFloat, "rows_linear: residual shape");
    res = residual->contiguous();
  }
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const W* wp = static_cast<const W*>(panels.const_data_ptr());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? res.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t stride = K * P;
  // A task is two adjacent panels (32 outputs), so one row keeps four sums in flight.
  at::parallel_for(0, (n_panels + 1) / 2, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * 2 * P);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p0 = 2 * t, np = std::min<int64_t>(2, n_panels - p0);
      const bool paired512 = use_avx512 && (M == 3 || M == 4) && np == 2;
      const W* w = wp + p0 * stride;
      std::fill(acc.begin(), acc.end(), 0.f);
      if (M <= 2 && np == 2) {  // [M][32]
        if (M == 1) tile<2, 1, W>(xp, K, 0, K, w, stride, acc.data());
        else tile<2, 2, W>(xp, K, 0, K, w, stride, acc.data());
      } else if (paired512) {  // [M][32]: 3-4 rows, two panels a pass, each row broadcast once for both
        if (M == 3) tile512<2, 3, W>(xp, K, 0, K, w, stride, acc.data());
        else tile512<2, 4, W>(xp, K, 0, K, w, stride, acc.data());
      } else {  // one panel at a time, rows in blocks of 4; above 4 rows k in tiles: [panel][M][16]
        const int64_t k_step = M <= 4 ? K : K_TILE;
        for (int64_t q = 0; q < np; ++q)
          for (int64_t k0 = 0; k0 < K; k0 += k_step)
            for (int64_t m0 = 0; m0 < M; m0 += 4)
              block<1, W>(xp + m0 * K, std::min<int64_t>(4, M - m0), K, k0, std::min(K, k0 + k_step),
                          w + q * stride, stride, acc.data() + (q * M + m0) * P);
      }
      const bool paired = (M <= 2 && np == 2) || paired512;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < np * P; ++j) {
          const int64_t n = p0 * P + j;
          if (n >= N) break;
          float v = paired ? acc[m * 2 * P + j] : acc[((j / P) * M + m) * P + j % P];
          if (scale) v *= scale[n];
          if (bp) v += bp[n];
          if (rp) v += rp[m * N + n];
          yp[m * N + n] = v;
        }
    }
  });
  return y;
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  if (panels.dtype() == at::kBFloat16) return run<uint16_t>(x, panels, out_features, nullptr, bias, residual);
  TORCH_CHECK(panels.dtype() == at::kFloat, "rows_linear: float32 or bfloat16 weights only");
  return run<float>(x, panels, out_features, nullptr, bias, residual);
}

at::Tensor rows_linear_int8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(panels.dtype() == at::kChar, "rows_linear_int8: int8 weights only");
  TORCH_CHECK(scale.dtype() == at::kFloat && scale.is_contiguous(), "rows_linear_int8: float32 scales only");
  return run<int8_t>(x, panels, scale.numel(), scale.data_ptr<float>(), bias, residual);
}

}  // namespace

TORCH_LIBRARY(tsengine_cpu, lib) {
  lib.def("rows_linear(Tensor x, Tensor panels, int out_features, Tensor? bias, Tensor? residual) -> Tensor");
  lib.def("rows_linear_int8(Tensor x, Tensor panels, Tensor scale, Tensor? bias, Tensor? residual) -> Tensor");
  // which tile 3+ rows take: avx512 where the CPU has it (the default); -1 reads it, 0/1 sets it (tests, bench)
  lib.def("rows_linear_avx512(int on) -> bool", [](int64_t on) {
    if (on >= 0) use_avx512 = on && __builtin_cpu_supports("avx512f");
    return use_avx512;
  });
}

TORCH_LIBRARY_IMPL(tsengine_cpu, CPU, lib) {
  lib.impl("rows_linear", &rows_linear);
  lib.impl("rows_linear_int8", &rows_linear_int8);
}
