// The bf16 decode tasks of paged_decode.h with AVX512-BF16 (head_dim a multiple of 32, at most 256).
//
// The generic tasks spend most of their time on arithmetic around the loads: each token's K row is
// widened to float and reduced across lanes once per query head, and the softmax calls a scalar exp.
// Here q . k multiplies the bf16 K row as it lies in the cache (VDPBF16PS: exact products, float sums),
// 16 tokens' partial sums are reduced together in one transposing add tree, and exp is vectorized.
// P . V stays in float as before. Sums are taken in another order than the generic tasks', so results
// differ from theirs in the last bits (the tests hold both to a float32 reference).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGEDLLM_DECODE_BF16 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "../../csrc/bf16_vec.h"

namespace paged {

// out lane i = the sum of v[i]'s 16 lanes: pairs, then quads, then 128-bit chunks are added, 45
// instructions for 16 rows where 16 separate reductions take about twice as many.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // chunk j of a[i]: v[2i] at 0 and 2, v[2i+1] at 1 and 3
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // chunk j of b[i]: chunk j's sums of v[4i .. 4i+3] (pairs moved as doubles)
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // chunks of b[2i], b[2i+1] added in pairs: (0+1, 2+3) of each
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf: 2^n * e^r with |r| <= ln2 / 2 and a
// degree-6 polynomial, within 2 ulp of std::exp
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // below, e^x is under float's smallest normal
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// softmax of each of `rows` rows of `len` scores, in place, 16 at a time
inline void softmax_rows_avx512(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 k = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
      m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, sg + t));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 k = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + t), mx));
      _mm512_mask_storeu_ps(sg + t, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 k = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
      _mm512_mask_storeu_ps(sg + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sg + t), inv));
    }
  }
}

// decode_tasks (paged_decode.h) for bf16 with D = head_dim, a multiple of 32 up to 256, and G query heads
// per KV head (fixed at compile time so that P . V's G x D float sums stay in registers)
template <int64_t D, int64_t G>
void decode_tasks_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                       const c10::BFloat16* v_cache, const int64_t* tables, const int64_t* lens, c10::BFloat16* out,
                       int64_t H, int64_t KVH, int64_t BS, int64_t max_blocks, float scale, const int64_t* order,
                       int64_t begin, int64_t end) {
  (void)H;  // = G * KVH
  static_assert(D % 32 == 0 && D <= 256, "decode_tasks_bf16: head_dim a multiple of 32 up to 256");
  constexpr int64_t QV = D / 32;  // 512-bit vectors of bf16 in a row
  constexpr int64_t FV = D / 16;  // ... of float
  std::vector<float> scores;
  const c10::BFloat16* rows[16];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = order[task / KVH], h = task % KVH;  // task i: the (order[i / KVH], i % KVH) pair
    const int64_t L = lens[b];
    const int64_t* table = tables + b * max_blocks;
    scores.resize(G * L);
    // scores = scale * (q . k), 16 positions at a time: each position's D/32 VDPBF16PS per query head
    // leave 16 partial sums, which sum_lanes_16 turns into 16 scores
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - t0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        rows[i] = k_cache + ((table[t / BS] * BS + t % BS) * KVH + h) * D;
        // a sequence's blocks are scattered, so the hardware prefetcher cannot guess the next one: each
        // position's rows one block ahead (K, and V for the second pass) are asked for now
        if (t + BS < L) {
          const int64_t ahead = ((table[t / BS + 1] * BS + t % BS) * KVH + h) * D;
          for (int64_t d = 0; d < D; d += 32) {
            __builtin_prefetch(k_cache + ahead + d, 0, 3);
            __builtin_prefetch(v_cache + ahead + d, 0, 2);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const c10::BFloat16* qg = q + b * q_stride + (h * G + g) * D;
        __m512bh qv[QV];
        for (int64_t j = 0; j < QV; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qg + 32 * j);
        __m512 partial[16];
        for (int64_t i = 0; i < 16; ++i) {
          partial[i] = _mm512_setzero_ps();
          if (i < n)
            for (int64_t j = 0; j < QV; ++j)
              partial[i] = _mm512_dpbf16_ps(partial[i], (__m512bh)_mm512_loadu_si512(rows[i] + 32 * j), qv[j]);
        }
        const __mmask16 k = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        _mm512_mask_storeu_ps(scores.data() + g * L + t0, k,
                              _mm512_mul_ps(sum_lanes_16(partial), _mm512_set1_ps(scale)));
      }
    }
    softmax_rows_avx512(scores.data(), G, L);
    // out = p . v: each V row widened to float once, then every query head's FMAs
    __m512 acc[G][FV];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const int64_t slot = table[t / BS] * BS + t % BS;
      const c10::BFloat16* v = v_cache + (slot * KVH + h) * D;
      if (t + BS < L)
        for (int64_t d = 0; d < D; d += 32)
          __builtin_prefetch(v_cache + ((table[t / BS + 1] * BS + t % BS) * KVH + h) * D + d, 0, 3);
      __m512 vf[FV];
      for (int64_t j = 0; j < FV; ++j) vf[j] = bf16vec::load(v + 16 * j, 0xFFFF);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * L + t]);
        for (int64_t j = 0; j < FV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vf[j], acc[g][j]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < FV; ++j) bf16vec::store(out + (b * H + h * G + g) * D + 16 * j, 0xFFFF, acc[g][j]);
  }
}

using DecodeTasksBF16 = decltype(&decode_tasks_bf16<64, 1>);

// the instantiation for head_dim D and G query heads per KV head, or nullptr (the generic tasks then run)
template <int64_t D>
DecodeTasksBF16 decode_tasks_bf16_for(int64_t G) {
  switch (G) {
    case 1: return decode_tasks_bf16<D, 1>;
    case 2: return decode_tasks_bf16<D, 2>;
    case 3: return decode_tasks_bf16<D, 3>;
    case 4: return decode_tasks_bf16<D, 4>;
    case 5: return decode_tasks_bf16<D, 5>;
    case 6: return decode_tasks_bf16<D, 6>;
    case 7: return decode_tasks_bf16<D, 7>;
    case 8: return decode_tasks_bf16<D, 8>;
    default: return nullptr;
  }
}

inline DecodeTasksBF16 decode_tasks_bf16_for(int64_t D, int64_t G) {
  return D == 64 ? decode_tasks_bf16_for<64>(G) : D == 128 ? decode_tasks_bf16_for<128>(G) : nullptr;
}

}  // namespace paged

#endif
