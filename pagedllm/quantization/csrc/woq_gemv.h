// Weight-only quantized matrix-vector products for 1-4 rows of bf16 activations with AVX512-VNNI, over
// the AMX kernel's layout (woq_amx.cpp describes it and binds this for Python; model/csrc/decode_stack.cpp
// calls it directly).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "woq_amx.h"  // the layout, kTile

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // as woq_amx.h: the same instructions in every build

namespace woq {

constexpr int64_t kGemvMaxRows = 4;  // amx.GEMV_MAX_ROWS

// For 1-4 rows the AMX tiles are mostly padding, and dequantizing every weight to bf16 (float32 convert,
// multiply, add, round) costs more than the dot product itself. Here x is rounded to int8 per 32 inputs, as
// the AVX2 kernel does (x_k ~ d_b xq_k, d_b = max|x| / 127 over block b), and VPDPBUSD multiplies the codes
// themselves (unsigned bytes) with xq, so a group's result is
//     sum_k x_k (s q_k + m) ~ s * sum_b d_b (sum_{k in b} xq_k q_k) + m * (sum_k x_k),
// one scale and one min applied per group and 16 columns, not per weight; the min's term takes the float
// sum of x itself. A VNNI dot product sums four bytes a 32-bit lane, where the layout pairs inputs for
// bf16 (e = 2n + k % 2): one VPERMB a 64-byte line of codes brings each column's four inputs together.
//
// Why not bf16 dot products on the codes (the kernel before): each 32 codes took ~7 instructions to become
// bf16 and a VDPBF16PS does 32 products, so at one row it ran at ~12 GB/s of codes on a 2-core AMX Xeon,
// half the memory's bandwidth; this does 128 4-bit products in ~9 instructions.

// Each row's int8 codes, block scales d_b and group sums of x (float32), made once per call for all threads.
struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / 32]
  std::vector<float> xsum;   // [M, groups]
  std::vector<int8_t> wide;  // 4-bit only: [M, K / 8, 64]: per 8 inputs, xq[0..3] in 32-bit lanes 0-7, xq[4..7] in 8-15
};

inline void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t group_size, int64_t bits,
                          QuantizedRows& r) {
  const int64_t blocks = K / 32, groups = K / group_size;
  r.q.resize(M * K);
  r.d.resize(M * blocks);
  r.xsum.assign(M * groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const at::BFloat16* xb = x + m * K + b * 32;
      const __m512 lo = _mm512_cvtpbh_ps(reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))));
      const __m512 hi = _mm512_cvtpbh_ps(reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))));
      const float am = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(am > 0.f ? 127.f / am : 0.f);
      const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)));
      const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + m * K + b * 32), q0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + m * K + b * 32 + 16), q1);
      r.d[m * blocks + b] = am / 127.f;
      r.xsum[m * groups + b * 32 / group_size] += _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  if (bits != 4) return;
  r.wide.resize(M * K * 8);
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 8) {
      const __m512i v = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.q.data() + m * K + k)));
      _mm512_storeu_si512(r.wide.data() + (m * K + k) * 8, _mm512_permutexvar_epi32(idx, v));
    }
}

// VPERMB indices: 64 bytes of codes (4-bit: four pair rows of nibbles; 8-bit: two pair rows) -> 32-bit lane L
// holding one column's four consecutive inputs. 4-bit (the nibbles of each half apart): lanes 0-7 columns
// 0-7 of pair rows 0-1, lanes 8-15 the same columns of pair rows 2-3; 8-bit: lane L column L of both rows.
inline __m512i vnni_order(int bits) {
  alignas(64) uint8_t idx[64];
  for (int L = 0; L < 16; ++L) {
    const int c = L % 8, base = bits == 4 ? (L < 8 ? 0 : 32) : 0, col = bits == 4 ? c : L;
    const int row_bytes = bits == 4 ? 16 : 32;
    idx[4 * L + 0] = uint8_t(base + 2 * col);
    idx[4 * L + 1] = uint8_t(base + 2 * col + 1);
    idx[4 * L + 2] = uint8_t(base + row_bytes + 2 * col);
    idx[4 * L + 3] = uint8_t(base + row_bytes + 2 * col + 1);
  }
  return _mm512_load_si512(idx);
}

// How far ahead the loop asks for codes, scales and mins. Decode-time weights come from L3 / DRAM, and a
// call is too short for the hardware prefetcher to ramp up: the 120 decoder calls of a single-stream step
// of the default model took 16.3 ms without, 8.4 ms at 1 KB / 4 groups ahead, 6.5 ms at 2 KB / 8 groups
// (2 threads; 4 KB / 16 groups the same, 8 KB / 32 slower).
constexpr int64_t kPrefetchCodeBytes = 2048, kPrefetchGroups = 8;

template <int BITS, int M, typename Sc, typename Mn>
void gemv_subtiles(const QuantizedRows& xr, int64_t K, const uint8_t* codes, const Sc& scales, const Mn& mins,
                   const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
                   int64_t ns_end) {
  const int64_t groups = K / group_size, blocks_per_group = group_size / 32, blocks = K / 32;
  constexpr int64_t kBlockBytes = BITS * 16 * 32 / 8;  // one subtile's codes of 32 inputs: 256 or 512
  const __m512i order = vnni_order(BITS), nibble = _mm512_set1_epi8(0x0F);
  for (int64_t ns = ns_begin; ns < ns_end; ++ns) {
    const uint8_t* c = codes + ns * (K / 2) * (BITS == 4 ? 16 : 32);
    __m512 y[M];
    for (int m = 0; m < M; ++m) y[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_line(scales.line(ns, g + kPrefetchGroups));  // past the last group: the next subtile's first
      prefetch_line(mins.line(ns, g + kPrefetchGroups));
      __m512 gsum[M];
      for (int m = 0; m < M; ++m) gsum[m] = _mm512_setzero_ps();
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const uint8_t* cb = c + b * kBlockBytes;
        __m512i acc[M][2];  // 4-bit: the low nibbles' columns 0-7 and the high ones' 8-15 (lanes split by k)
        for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
        for (int64_t line = 0; line < kBlockBytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(cb + line + kPrefetchCodeBytes), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(cb + line);
          if constexpr (BITS == 4) {
            const __m512i lo = _mm512_permutexvar_epi8(order, _mm512_and_si512(v, nibble));
            const __m512i hi = _mm512_permutexvar_epi8(order, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
            const int64_t k = b * 32 + line / 8;  // the line's first input: 8 inputs a line
            for (int m = 0; m < M; ++m) {
              const __m512i xw = _mm512_loadu_si512(xr.wide.data() + (m * K + k) * 8);
              acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], lo, xw);
              acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], hi, xw);
            }
          } else {
            const __m512i w = _mm512_permutexvar_epi8(order, v);
            const int64_t k = b * 32 + line / 16;  // 4 inputs a line
            for (int m = 0; m < M; ++m) {
              int32_t x4;
              std::memcpy(&x4, xr.q.data() + m * K + k, 4);
              acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], w, _mm512_set1_epi32(x4));
            }
          }
        }
        for (int m = 0; m < M; ++m) {
          __m512i dot = acc[m][0];
          if constexpr (BITS == 4)  // [lo k0-3 | lo k4-7] + [hi k0-3 | hi k4-7] -> columns 0-15 in order
            dot = _mm512_add_epi32(_mm512_shuffle_i64x2(acc[m][0], acc[m][1], 0x44),
                                   _mm512_shuffle_i64x2(acc[m][0], acc[m][1], 0xEE));
          gsum[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xr.d[m * blocks + b]), gsum[m]);
        }
      }
      const __m512 s = scales.at(ns, g);
      const __m512 mn = mins.at(ns, g, s);
      for (int m = 0; m < M; ++m) {
        y[m] = _mm512_fmadd_ps(s, gsum[m], y[m]);
        y[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xr.xsum[m * groups + g]), y[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      store_bf16(out + m * N + ns * kTile, bias ? _mm512_add_ps(y[m], _mm512_loadu_ps(bias + ns * kTile)) : y[m]);
  }
}

// out[M, N] (row stride N) = x[M, K] (rounded in xr) @ W^T for output subtiles [ns_begin, ns_end), M 1..4.
template <typename Sc, typename Mn>
void gemv(int64_t M, int64_t bits, const QuantizedRows& xr, int64_t K, const uint8_t* codes, const Sc& scales,
          const Mn& mins, const float* bias, int64_t group_size, int64_t N, at::BFloat16* out, int64_t ns_begin,
          int64_t ns_end) {
#define WOQ_GEMV_CASE(B, R) \
  if (bits == B && M == R) \
    return gemv_subtiles<B, R, Sc, Mn>(xr, K, codes, scales, mins, bias, group_size, N, out, ns_begin, ns_end);
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
  thread_local QuantizedRows rows;  // kept from call to call: no allocation a step
  QuantizedRows& xr = rows;  // this thread's, which the other threads read (by name they would see their own)
  quantize_rows(x, M, K, group_size, bits, xr);
  with_groups(scales, mins, K / group_size, [&](const auto& sc, const auto& mn) {
    at::parallel_for(0, N / kTile, grain, [&](int64_t begin, int64_t end) {
      gemv(M, bits, xr, K, c, sc, mn, bias, group_size, N, out, begin, end);
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
