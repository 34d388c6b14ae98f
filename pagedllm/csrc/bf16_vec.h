// 16 bf16 values at a time as float32 with AVX-512, for the element-wise layer ops
// (model/layers/csrc/layer_ops.h) and the decode attention (attention/csrc/paged_decode_bf16.h).
//
// The scalar loops converted element by element through c10::BFloat16; these convert 16 at a time and
// round exactly as c10::BFloat16(float) does (to nearest even in integer arithmetic, denormals kept, NaN
// as 0x7FC0), so results stay bit for bit. A small gain: at a 32-row decode step the norms, rotary and
// SiLU product went from ~4.9 to ~4.4 ms of a ~36 ms step (their thread hand-offs and ATen's mean, not
// the conversions, are most of what is left). Loads and stores take a lane mask, for the tail of a row.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDLLM_BF16_VEC 1

#include <immintrin.h>

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace bf16vec {

// the lanes of a 16-wide chunk starting at i that lie in a row of n
inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
}

inline __m512 widen(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load(const c10::BFloat16* p, __mmask16 k) { return widen(_mm256_maskz_loadu_epi16(k, p)); }

// bf16 bits of x, as c10::detail::round_to_nearest_even computes them, in integer arithmetic
inline __m256i round_bits_exact(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}

// The same bits. VCVTNEPS2BF16 rounds to nearest even as c10 does, in one instruction instead of eight,
// but flushes denormal inputs to zero and keeps a NaN's payload where c10 writes 0x7FC0: a chunk holding
// either takes the integer path (fpclass 0xA1: quiet NaN, signalling NaN, denormal).
inline __m256i round_bits(__m512 x) {
#ifdef __AVX512BF16__
  if (_mm512_fpclass_ps_mask(x, 0xA1) == 0) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#endif
  return round_bits_exact(x);
}

// float(bf16(x)): the rounding a torch op's bf16 output applies, kept in float for the next step
inline __m512 round(__m512 x) { return widen(round_bits(x)); }

inline void store(c10::BFloat16* p, __mmask16 k, __m512 x) { _mm256_mask_storeu_epi16(p, k, round_bits(x)); }

}  // namespace bf16vec

#endif
