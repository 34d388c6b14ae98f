// Weight-only quantized matrix-vector products for 1-8 rows of bf16 activations with AVX512-VNNI int8 dot
// products, over the AMX kernel's layout (woq_amx.cpp describes it and binds this for Python;
// model/csrc/decode_stack.cpp calls it directly).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "woq_amx.h"   // the layout, kTile
#include "woq_avx2.h"  // quantize_row: x rounded as the AVX2 layout's kernel rounds it

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // as woq_amx.h: the same instructions in every build

namespace woq {

constexpr int64_t kGemvMaxRows = 8;  // amx.GEMV_MAX_ROWS

// For 1-8 rows the AMX tiles are mostly padding, and dequantizing every weight to bf16 costs more than the
// product itself. Here, as in the AVX2 layout's kernel (woq_avx2.h, whose activation rounding this shares),
// x is rounded to int8 per 32-input block, x_k ~ d_b xq_k, and the codes themselves go into VPDPBUSD
// (unsigned codes times signed activations, four products summed into each int32 lane):
//     sum_k x_k (s q_k + m) ~ s d_b (sum_k q_k xq_k) + m (d_b sum_k xq_k),
// integer dot products exact in int32, then per 32-block and 16 columns one convert and two FMAs.
// Accuracy contract (woq_avx2.h's): the float32 reference on x rounded per 32-block, up to float32
// summation order (tests/test_quant_linear.py). Not bit-equal to the AMX tiles (bf16 x, bf16-rounded
// weights) above 8 rows, as the bf16 dot products this replaces were not either.
//
// Why int8 and not bf16 dot products: a 64-byte line of 4-bit codes (128 weights) is 2 VPDPBUSD here against
// 4 VDPBF16PS plus the decoding to bf16 (~20 instructions a line, ~18 cycles: 62-67% of a 2-core Xeon's
// read bandwidth on a 1B model; the int8 way leaves the loop bound by memory).
//
// The layout pairs inputs (e = 2n + k % 2: a 16-bit word is one column's two codes), VPDPBUSD wants four
// inputs of one column in each 32-bit lane, so one word permute a vector puts pair rows p and p+1 side by
// side: 4-bit, a line is pair rows p..p+3, the low nibbles columns 0-7 and the high nibbles columns 8-15;
// 8-bit, a line is pair rows p, p+1 with all 16 columns.

// The word indices: lane n of A takes column n's words of pair rows 0 and 1 of the line, of B pair rows 2, 3;
// for 4-bit, columns 8-15 from the second source (the line shifted right by 4: its high nibbles).
inline __m512i nibble_quad_index(int first_row) {
  alignas(64) int16_t idx[32];
  for (int n = 0; n < 16; ++n) {
    const int src = n < 8 ? 0 : 32, col = n & 7;
    idx[2 * n] = int16_t(src + 8 * first_row + col);
    idx[2 * n + 1] = int16_t(src + 8 * (first_row + 1) + col);
  }
  return _mm512_load_si512(idx);
}

inline __m512i byte_quad_index() {
  alignas(64) int16_t idx[32];
  for (int n = 0; n < 16; ++n) idx[2 * n] = int16_t(n), idx[2 * n + 1] = int16_t(16 + n);
  return _mm512_load_si512(idx);
}

// How far ahead the loop asks for codes, scales and mins. Decode-time weights come from L3 / DRAM, and a
// call is too short for the hardware prefetcher to ramp up: the 120 decoder calls of a single-stream step
// of the default model took 16.3 ms without, 8.4 ms at 1 KB / 4 groups ahead, 6.5 ms at 2 KB / 8 groups
// (2 threads; 4 KB / 16 groups the same, 8 KB / 32 slower).
constexpr int64_t kPrefetchCodeBytes = 2048, kPrefetchGroups = 8;
// x rounded per 32-block as the AVX2 kernel rounds it (woq_avx2::quantize_row): codes q [M, K], block scales
// d and d x code sums ds [M, K/32] (QuantizedX's other fields unused here)
using woq_avx2::QuantizedX;
constexpr int64_t kXBlock = woq_avx2::kBlock;

template <int BITS, int M, typename Sc, typename Mn>
void gemv_subtiles(const QuantizedX& xr, int64_t K, const uint8_t* codes, const Sc& scales, const Mn& mins,
                   const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
                   int64_t ns_end) {
  const int64_t groups = K / group_size, blocks_per_group = group_size / kXBlock, nb = K / kXBlock;
  const int64_t code_row_bytes = BITS == 4 ? 16 : 32;  // a pair row: 16 columns x 2 inputs
  const __m512i idx_a = BITS == 4 ? nibble_quad_index(0) : byte_quad_index();
  const __m512i idx_b = nibble_quad_index(2);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t ns = ns_begin; ns < ns_end; ++ns) {
    const uint8_t* c = codes + ns * (K / 2) * code_row_bytes;
    __m512 y[M];
    for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_line(scales.line(ns, g + kPrefetchGroups));  // past the last group: the next subtile's first
      prefetch_line(mins.line(ns, g + kPrefetchGroups));
      const __m512 s = scales.at(ns, g);
      const __m512 mn = mins.at(ns, g, s);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        // four partial sums a row: a VPDPBUSD waits on the previous one into the same register
        __m512i acc[M][4];
        for (int m = 0; m < M; ++m)
          for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
        const uint8_t* cb = c + b * (kXBlock / 2) * code_row_bytes;  // the block's 16 pair rows
        constexpr int kLines = BITS == 4 ? 4 : 8;  // 64-byte lines a block
        for (int l = 0; l < kLines; ++l) {
          const uint8_t* line = cb + 64 * l;
          _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchCodeBytes), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(line);
          if constexpr (BITS == 4) {  // inputs 8l..8l+3 (A) and 8l+4..8l+7 (B) of the block
            const __m512i v4 = _mm512_srli_epi16(v, 4);
            const __m512i wa = _mm512_and_si512(_mm512_permutex2var_epi16(v, idx_a, v4), low4);
            const __m512i wb = _mm512_and_si512(_mm512_permutex2var_epi16(v, idx_b, v4), low4);
            for (int m = 0; m < M; ++m) {
              const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q + m * K + b * kXBlock + 8 * l);
              const int j = 2 * (l & 1);
              acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wa, _mm512_set1_epi32(xq[0]));
              acc[m][j + 1] = _mm512_dpbusd_epi32(acc[m][j + 1], wb, _mm512_set1_epi32(xq[1]));
            }
          } else {  // inputs 4l..4l+3 of the block
            _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchCodeBytes + 64), _MM_HINT_T0);
            const __m512i w = _mm512_permutexvar_epi16(idx_a, v);
            for (int m = 0; m < M; ++m) {
              const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q + m * K + b * kXBlock + 4 * l);
              acc[m][l & 3] = _mm512_dpbusd_epi32(acc[m][l & 3], w, _mm512_set1_epi32(xq[0]));
            }
          }
        }
        for (int m = 0; m < M; ++m) {
          const __m512i isum =
              _mm512_add_epi32(_mm512_add_epi32(acc[m][0], acc[m][1]), _mm512_add_epi32(acc[m][2], acc[m][3]));
          // fused explicitly: the same instructions whatever -ffp-contract a build uses
          const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xr.d[m * nb + b]));
          y[m] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(isum), y[m]);
          y[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xr.ds[m * nb + b]), y[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      store_bf16(out + m * N + ns * kTile, bias ? _mm512_add_ps(y[m], _mm512_loadu_ps(bias + ns * kTile)) : y[m]);
  }
}

// out[M, N] (row stride N) = x[M, K] (row stride K) @ W^T for output subtiles [ns_begin, ns_end), M 1..4.
template <typename Sc, typename Mn>
void gemv_pass(int64_t M, int64_t bits, const QuantizedX& x, int64_t K, const uint8_t* codes, const Sc& scales,
               const Mn& mins, const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
               int64_t ns_end) {
#define WOQ_GEMV_CASE(B, R) \
  if (bits == B && M == R) \
    return gemv_subtiles<B, R, Sc, Mn>(x, K, codes, scales, mins, bias, group_size, N, out, ns_begin, ns_end);
  WOQ_GEMV_CASE(4, 1) WOQ_GEMV_CASE(4, 2) WOQ_GEMV_CASE(4, 3) WOQ_GEMV_CASE(4, 4)
  WOQ_GEMV_CASE(8, 1) WOQ_GEMV_CASE(8, 2) WOQ_GEMV_CASE(8, 3) WOQ_GEMV_CASE(8, 4)
#undef WOQ_GEMV_CASE
}

// Rows a pass over the codes takes (the accumulators of 4 rows fill the registers); above, each span of
// subtiles (~kSpanBytes of codes, from L2 after the first pass) runs every 4 rows in turn, so the codes
// still come from memory once: at 8 rows one call costs ~1.4 single-row calls, not 2.
constexpr int64_t kGemvPassRows = 4, kSpanBytes = 64 << 10;

template <typename Sc, typename Mn>
void gemv(int64_t M, int64_t bits, const QuantizedX& x, int64_t K, const uint8_t* codes, const Sc& scales,
          const Mn& mins, const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
          int64_t ns_end) {
  if (M <= kGemvPassRows)
    return gemv_pass(M, bits, x, K, codes, scales, mins, bias, group_size, N, out, ns_begin, ns_end);
  const int64_t nb = K / kXBlock, span = std::max<int64_t>(1, kSpanBytes / (K * kTile * bits / 8));
  for (int64_t ns = ns_begin; ns < ns_end; ns += span)
    for (int64_t r = 0; r < M; r += kGemvPassRows) {
      const QuantizedX rows{x.q + r * K, x.d + r * nb, x.ds + r * nb, K};
      gemv_pass(std::min(kGemvPassRows, M - r), bits, rows, K, codes, scales, mins, bias, group_size, N,
                out + r * N, ns, std::min(ns + span, ns_end));
    }
}

// x [M, K] (M 1..8, rows K apart) times the layer in the AMX layout into out [M, N]; bias float32 [N] or
// nullptr: the column subtiles split between threads. gemv_tensor's kernel, and the decode stack's for
// its small steps (model/csrc/decode_stack.cpp), on raw pointers.
inline void gemv_into(int64_t M, int64_t bits, const at::BFloat16* x, int64_t K, const at::Tensor& codes,
                      const at::Tensor& scales, const at::Tensor& mins, const float* bias, int64_t group_size,
                      int64_t N, at::BFloat16* out) {
  // a task of at least ~16 KB of codes before a second thread is woken
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(K * 16 * bits / 8, 1));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  // x rounded once a call, on the calling thread (K bytes a row: cheap beside the N K / 2 bytes of codes)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, ds;
  q.resize(M * K), d.resize(M * K / kXBlock), ds.resize(M * K / kXBlock);
  for (int64_t m = 0; m < M; ++m)
    woq_avx2::quantize_row(x + m * K, K, q.data() + m * K, d.data() + m * K / kXBlock, ds.data() + m * K / kXBlock);
  const QuantizedX xr{q.data(), d.data(), ds.data(), K};
  with_groups(scales, mins, K / group_size, [&](const auto& sc, const auto& mn) {
    at::parallel_for(0, N / kTile, grain, [&](int64_t begin, int64_t end) {
      gemv(M, bits, xr, K, c, sc, mn, bias, group_size, N, out, begin, end);
    });
  });
}

// x [M, K] bf16 (M 1..8) times the layer in the AMX layout; bias float32 [N] or undefined. The buffers'
// shapes are the caller's to check (woq_amx.cpp's check_args).
inline at::Tensor gemv_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const at::Tensor& bias, int64_t bits, int64_t group_size,
                              int64_t N) {
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvMaxRows, "woq_amx: gemv takes 1 to 8 rows");
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xa = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  gemv_into(M, bits, xa.data_ptr<at::BFloat16>(), K, codes, scales, mins,
            bias.defined() ? bias.data_ptr<float>() : nullptr, group_size, N, out.data_ptr<at::BFloat16>());
  return out;
}

// x [M, K] bf16 times a layer in the AMX layout (bits 4 or 8):
// the dot-product kernel for 1-8 rows, the AMX tiles above, as QuantLinear.path() chooses in Python.
inline at::Tensor linear_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& mins, const at::Tensor& bias, int64_t bits, int64_t group_size,
                                int64_t N) {
  if (x.size(0) >= 1 && x.size(0) <= kGemvMaxRows)
    return gemv_tensor(x, codes, scales, mins, bias, bits, group_size, N);
  return gemm_tensor(x, codes, scales, mins, bias, bits, group_size, N);
}

}  // namespace woq

#pragma GCC pop_options
