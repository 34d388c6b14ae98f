// Weight-only quantized matrix-vector products for 1-4 rows of bf16 activations with AVX512-BF16, over
// the AMX kernel's layout (woq_amx.cpp describes it and binds this for Python; model/csrc/decode_stack.cpp
// calls it directly).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "woq_amx.h"  // the layout, kTile

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // as woq_amx.h: the same instructions in every build

namespace woq {

constexpr int64_t kGemvMaxRows = 4;  // amx.GEMV_MAX_ROWS

// For 1-4 rows the AMX tiles are mostly padding, and dequantizing every weight to bf16 (float32 convert,
// multiply, add, round) costs more than the dot product itself. Here the codes themselves become bf16
// (small integers are exact in bf16) and VDPBF16PS multiplies them with x, so a group's result is
//     sum_k x_k (s q_k + m) = s * (sum_k x_k q_k) + m * (sum_k x_k),
// one scale and one min applied per group and 16 columns, not per weight. Exact products, float32 sums:
// closer to the float32 result than the dequantized-bf16 weights are (no per-weight rounding), so not
// bit-equal to the AMX path, as torch's INT4 kernel, which this replaces at small rows, was not either.
//
// 4-bit codes become bf16 by bit pattern: 0x4300 | q is the bf16 of 128 + q for q < 128, so the dot
// product sums x_k (q_k + 128) and 128 * sum_k x_k is taken off again per group.

// Two pair rows of 4-bit codes (32 bytes) -> two vectors of 32 bf16 values 128 + q, in e order.
inline void decode4_rows(const uint8_t* codes, __m512i& row0, __m512i& row1) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  const __m512i bias = _mm512_set1_epi16(0x4300);
  const __m512i lo = _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi16(0x0F)), bias);  // e 0..15
  const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(w, 4), bias);                        // e 16..31
  row0 = _mm512_shuffle_i64x2(lo, hi, 0x44);  // row 0's bytes sit in the low 256 bits of lo and hi
  row1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);
}

// One pair row of 8-bit codes (32 bytes) -> 32 bf16 values q (integers up to 256 are exact in bf16).
inline __m512i decode8_row(const uint8_t* codes) {
  const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 q1 =
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(q1, q0));
}

// How far ahead the loop asks for codes, scales and mins. Decode-time weights come from L3 / DRAM, and a
// call is too short for the hardware prefetcher to ramp up: the 120 decoder calls of a single-stream step
// of the default model took 16.3 ms without, 8.4 ms at 1 KB / 4 groups ahead, 6.5 ms at 2 KB / 8 groups
// (2 threads; 4 KB / 16 groups the same, 8 KB / 32 slower).
constexpr int64_t kPrefetchCodeBytes = 2048, kPrefetchGroups = 8;

template <int BITS, int M, typename Sc, typename Mn>
void gemv_subtiles(const at::BFloat16* x, int64_t K, const uint8_t* codes, const Sc& scales, const Mn& mins,
                   const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
                   int64_t ns_end) {
  const int64_t groups = K / group_size, pairs_per_group = group_size / 2;
  const int64_t code_row_bytes = BITS == 4 ? 16 : 32;
  const float offset = BITS == 4 ? 128.f : 0.f;  // what the bf16 bit pattern adds to every code
  // x as bf16 pairs (one 32-bit broadcast feeds a VDPBF16PS), and its sum over each group in float32
  const auto* xp = reinterpret_cast<const int32_t*>(x);
  std::vector<float> xsum(M * groups);
  for (int m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) s += float(x[m * K + k]);
      xsum[m * groups + g] = s;
    }
  for (int64_t ns = ns_begin; ns < ns_end; ++ns) {
    const uint8_t* c = codes + ns * (K / 2) * code_row_bytes;
    __m512 y[M];
    for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      // four partial sums a row: a VDPBF16PS waits on the previous one into the same register, so one
      // chain would run at its latency rather than at the decoding's pace
      __m512 d[M][4];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j) d[m][j] = _mm512_setzero_ps();
      const int64_t p0 = g * pairs_per_group;
      prefetch_line(scales.line(ns, g + kPrefetchGroups));  // past the last group: the next subtile's first
      prefetch_line(mins.line(ns, g + kPrefetchGroups));
      for (int64_t p = p0; p < p0 + pairs_per_group; p += 4) {  // pairs_per_group is a multiple of 16
        // one 64-byte line of codes a step for 4-bit (4 pair rows x 16 bytes), two for 8-bit
        _mm_prefetch(reinterpret_cast<const char*>(c + p * code_row_bytes + kPrefetchCodeBytes), _MM_HINT_T0);
        if constexpr (BITS == 8)
          _mm_prefetch(reinterpret_cast<const char*>(c + p * code_row_bytes + kPrefetchCodeBytes + 64), _MM_HINT_T0);
        __m512i w[4];
        if constexpr (BITS == 4) {
          decode4_rows(c + p * 16, w[0], w[1]);
          decode4_rows(c + (p + 2) * 16, w[2], w[3]);
        } else {
          for (int j = 0; j < 4; ++j) w[j] = decode8_row(c + (p + j) * 32);
        }
        for (int m = 0; m < M; ++m) {
          const int32_t* xr = xp + m * (K / 2);
          for (int j = 0; j < 4; ++j)
            d[m][j] = _mm512_dpbf16_ps(d[m][j], reinterpret_cast<__m512bh>(_mm512_set1_epi32(xr[p + j])),
                                       reinterpret_cast<__m512bh>(w[j]));
        }
      }
      const __m512 s = scales.at(ns, g);
      const __m512 mn = mins.at(ns, g, s);
      for (int m = 0; m < M; ++m) {
        const float xs = xsum[m * groups + g];
        const __m512 dm = _mm512_add_ps(_mm512_add_ps(d[m][0], d[m][1]), _mm512_add_ps(d[m][2], d[m][3]));
        // sum_k x_k q_k, fused explicitly: the same instructions whatever -ffp-contract a build uses
        const __m512 qsum = _mm512_fnmadd_ps(_mm512_set1_ps(offset), _mm512_set1_ps(xs), dm);
        y[m] = _mm512_fmadd_ps(s, qsum, y[m]);
        y[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs), y[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      store_bf16(out + m * N + ns * kTile, bias ? _mm512_add_ps(y[m], _mm512_loadu_ps(bias + ns * kTile)) : y[m]);
  }
}

// out[M, N] (row stride N) = x[M, K] (row stride K) @ W^T for output subtiles [ns_begin, ns_end), M 1..4.
template <typename Sc, typename Mn>
void gemv(int64_t M, int64_t bits, const at::BFloat16* x, int64_t K, const uint8_t* codes, const Sc& scales,
          const Mn& mins, const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
          int64_t ns_end) {
#define WOQ_GEMV_CASE(B, R) \
  if (bits == B && M == R) \
    return gemv_subtiles<B, R, Sc, Mn>(x, K, codes, scales, mins, bias, group_size, N, out, ns_begin, ns_end);
  WOQ_GEMV_CASE(4, 1) WOQ_GEMV_CASE(4, 2) WOQ_GEMV_CASE(4, 3) WOQ_GEMV_CASE(4, 4)
  WOQ_GEMV_CASE(8, 1) WOQ_GEMV_CASE(8, 2) WOQ_GEMV_CASE(8, 3) WOQ_GEMV_CASE(8, 4)
#undef WOQ_GEMV_CASE
}

// x [M, K] (M 1..4, rows K apart) times the layer in the AMX layout into out [M, N]; bias float32 [N] or
// nullptr: the column subtiles split between threads. gemv_tensor's kernel, and the decode stack's for
// its small steps (model/csrc/decode_stack.cpp), on raw pointers.
inline void gemv_into(int64_t M, int64_t bits, const at::BFloat16* x, int64_t K, const at::Tensor& codes,
                      const at::Tensor& scales, const at::Tensor& mins, const float* bias, int64_t group_size,
                      int64_t N, at::BFloat16* out) {
  // a task of at least ~16 KB of codes before a second thread is woken
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(K * 16 * bits / 8, 1));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  with_groups(scales, mins, K / group_size, [&](const auto& sc, const auto& mn) {
    at::parallel_for(0, N / kTile, grain, [&](int64_t begin, int64_t end) {
      gemv(M, bits, x, K, c, sc, mn, bias, group_size, N, out, begin, end);
    });
  });
}

// x [M, K] bf16 (M 1..4) times the layer in the AMX layout; bias float32 [N] or undefined. The buffers'
// shapes are the caller's to check (woq_amx.cpp's check_args).
inline at::Tensor gemv_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const at::Tensor& bias, int64_t bits, int64_t group_size,
                              int64_t N) {
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvMaxRows, "woq_amx: gemv takes 1 to 4 rows");
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xa = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  gemv_into(M, bits, xa.data_ptr<at::BFloat16>(), K, codes, scales, mins,
            bias.defined() ? bias.data_ptr<float>() : nullptr, group_size, N, out.data_ptr<at::BFloat16>());
  return out;
}

// x [M, K] bf16 times a layer in the AMX layout (bits 4 or 8):
// the dot-product kernel for 1-4 rows, the AMX tiles above, as QuantLinear.path() chooses in Python.
inline at::Tensor linear_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& mins, const at::Tensor& bias, int64_t bits, int64_t group_size,
                                int64_t N) {
  if (x.size(0) >= 1 && x.size(0) <= kGemvMaxRows)
    return gemv_tensor(x, codes, scales, mins, bias, bits, group_size, N);
  return gemm_tensor(x, codes, scales, mins, bias, bits, group_size, N);
}

}  // namespace woq

#pragma GCC pop_options
