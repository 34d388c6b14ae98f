// 4-bit, 8-bit and Q6_K panels two at a time in 512-bit registers, for builds with AVX512-VNNI (avx512_bf16
// and up). woq_avx2.h includes this after the layout's accessors, and run_panels calls it for every pair of
// adjacent panels of such a layer (panel_kernel / panel_kernel_q6 take an odd last one).
//
// Why: panel_kernel's 256-bit loop spends ~57 instructions on a 32-input block of a panel at one row
// (8 nibble unpacks, 8 activation broadcasts, 8 VPDPBUSD, the float32 scale and min, the loop and the
// prefetches), and a core runs out of issue slots before its vector units are busy. Here each vector
// holds panel p's 8 columns in its low half and panel p + 1's in the high half: both halves need the same
// 4 activation bytes, so one VPDPBUSD with its embedded 32-bit broadcast serves 16 columns, and one
// unpack, one convert and two FMAs do the work of two. Measured on a 2-core Zen 4 (scripts/
// ab_decode_stack.py, rounds alternated, bit-equal outputs): a W32 decode step of the 1B Q4_0 model
// 193.5 -> 123.0 ms, of the 1B Q4_K_M 194.5 -> 137.5 ms with 4-bit pairs alone and 201.8 -> 134.2 with
// Q6_K pairs too, of the default model 27.8 -> 21.2 ms; one thread on L2-resident layers 37 -> 47 GB/s;
// a single stream from DRAM the same (1B Q4_0 18.2 / 18.6 ms, default 2.71 / 2.69: memory-bound).
//
// Same arithmetic: per column these are panel_kernel's operations in its order (the block's exact int32
// sum, then the float32 multiply and two FMAs), so a pair's 16 results are bit for bit the two panels'
// results from panel_kernel, at every tier and batch size (tests/test_woq_avx2.py compares the builds).
#pragma once

#if defined(WOQ_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define WOQ_PAIRS 1

namespace woq_avx2 {

// acc + the 4-term dot products of w's unsigned bytes with the 4 signed bytes at x, which the instruction
// broadcasts to all 16 lanes itself. GCC 12 does not fold _mm512_set1_epi32 of a load into VPDPBUSD's
// m32bcst operand (it issues a VPBROADCASTD each time: 8 more instructions a block and row), hence asm.
inline __m512i dot4_bcast(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// Two streams of codes: each asks for its lines this far ahead into L2 (T1), and near a panel's end for
// the start of the panel it reads next, two panels on (p + 1 is the other stream's). One thread over a 1B
// model's layers from DRAM: 20 GB/s so; panel_kernel's 2 KB into L1 (T0) here gave 15, none at all 15,
// 8 KB ahead 20 (two streams' T0 lines fill L1's miss buffers). Only a strip's first row block asks
// (run_panels passes the others prefetch_groups 0: the strip is in L2 by then): a Q4_K 2048 -> 8192 layer
// at 2048 rows 498 -> 515 GOP/s, at 32 rows 1% faster (the two builds alternated in one process).
constexpr int64_t kAhead = 4096;

// two panels' 8-lane values as one vector: lo in lanes 0-7, hi in 8-15
inline __m512 pair_ps(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

inline __m512i pair_load(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

// each row's 16 sums: the low half is panel p's tile, the high half panel p + 1's
inline void store_pair(const __m512* acc, int R, float (*res0)[kCols], float (*res1)[kCols]) {
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res0[r], _mm512_castps512_ps256(acc[r]));
    _mm256_storeu_ps(res1[r], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
  }
}

// panel_kernel<BITS, R> (4 or 8) over panels p (codes0, sc0, mn0 -> res0) and p + 1 (codes1, sc1, mn1 -> res1).
// 8-bit codes are stored as q - 128 (signed), which panel_kernel multiplies by x with the abs / sign trick
// (VPSIGNB has no 512-bit form); here the sign bit is flipped back (q, unsigned, VPDPBUSD's unsigned
// operand) and 128 x the block's activation code sum (a.qs128, from quantize_row) taken off: sum (q - 128) xq,
// the same int32 exactly, then the same floats; derived mins (Q8_0) take c x the code sum instead (a.corr):
// sum (q + c) xq, panel_kernel's int32 again. The default model's Q8_0 lm_head (576 -> 49152, 2 threads):
// 32 rows 6.38 -> 4.28 ms, one row 0.50 -> 0.42.
template <int BITS, int R, typename S, bool DERIVED>
inline void pair_kernel(const QuantizedX& a, int64_t row0, const uint8_t* codes0, const uint8_t* codes1, S sc0,
                        S sc1, S mn0, S mn1, float, int64_t group_blocks, int64_t prefetch_groups,
                        float (*res0)[kCols], float (*res1)[kCols]) {
  constexpr int64_t kBlockBytes = block_bytes(BITS);
  const int64_t K = a.K, nb = K / kBlock, groups = nb / group_blocks, panel_bytes = nb * kBlockBytes;
  const XRows<R> xr(a, row0, false);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(char(0x80));
  const __m512 k128 = _mm512_set1_ps(128.f);
  const bool fetch = prefetch_groups > 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (fetch) {
      _mm_prefetch(reinterpret_cast<const char*>(sc0.addr(g + prefetch_groups)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sc1.addr(g + prefetch_groups)), _MM_HINT_T0);
      if constexpr (!DERIVED) {
        _mm_prefetch(reinterpret_cast<const char*>(mn0.addr(g + prefetch_groups)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(mn1.addr(g + prefetch_groups)), _MM_HINT_T0);
      }
    }
    const __m512 s = pair_ps(sc0.at(g), sc1.at(g));
    [[maybe_unused]] __m512 m;
    if constexpr (!DERIVED) {
      m = pair_ps(mn0.at(g), mn1.at(g));
      // 8-bit codes are stored as q - 128: s q + m = s (q - 128) + (m + 128 s), as panel_kernel
      if constexpr (BITS == 8) m = _mm512_fmadd_ps(k128, s, m);
    }
    for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
      const uint8_t* c0 = codes0 + b * kBlockBytes;
      const uint8_t* c1 = codes1 + b * kBlockBytes;
      const int64_t ahead = kAhead + (b * kBlockBytes + kAhead >= panel_bytes ? panel_bytes : 0);  // kAhead
      if (fetch)
        for (int64_t line = 0; line < kBlockBytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(c0 + ahead + line), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(c1 + ahead + line), _MM_HINT_T1);
        }
      __m512i w[8];  // quad j (k = 4j + i) of both panels as unsigned codes
      if constexpr (BITS == 4) {
        for (int v = 0; v < 4; ++v) {  // vector v: k = 4v + i (low nibbles), 16 + 4v + i (high)
          const __m512i raw = pair_load(c0 + 32 * v, c1 + 32 * v);
          w[v] = _mm512_and_si512(raw, nibble);
          w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
      } else {
        for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(pair_load(c0 + 32 * j, c1 + 32 * j), sign);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xr.q[r] + b * kBlock;
        __m512i isum;
        if constexpr (R == 1) {
          // two chains: one row has no other row's products to fill a VPDPBUSD's latency with (at more
          // rows, two chains each ran a W32 step of the 1B Q4_K_M 4% slower: 137.6 against 132.7 ms)
          __m512i p = dot4_bcast(_mm512_setzero_si512(), w[0], x);
          __m512i q = dot4_bcast(_mm512_setzero_si512(), w[4], x + 16);
          for (int j = 1; j < 4; ++j) {
            p = dot4_bcast(p, w[j], x + 4 * j);
            q = dot4_bcast(q, w[j + 4], x + 16 + 4 * j);
          }
          isum = _mm512_add_epi32(p, q);
        } else {
          isum = dot4_bcast(_mm512_setzero_si512(), w[0], x);
          for (int j = 1; j < 8; ++j) isum = dot4_bcast(isum, w[j], x + 4 * j);
        }
        if constexpr (DERIVED)
          isum = _mm512_add_epi32(isum, _mm512_set1_epi32(xr.corr[r][b]));
        else if constexpr (BITS == 8)
          isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(xr.qs128[r][b]));
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(xr.d[r][b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
        if constexpr (!DERIVED) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xr.ds[r][b]), acc[r]);
      }
    }
  }
  store_pair(acc, R, res0, res1);
}

// panel_kernel_q6<R> (GGUF Q6_K: 6-bit codes, group 16, mins -32 x the scales) over panels p and p + 1
template <int R, typename S>
inline void pair_kernel_q6(const QuantizedX& a, int64_t row0, const uint8_t* codes0, const uint8_t* codes1, S sc0,
                           S sc1, int64_t prefetch_groups, float (*res0)[kCols], float (*res1)[kCols]) {
  constexpr int64_t kBlockBytes = block_bytes(6);
  const int64_t K = a.K, nb = K / kBlock, panel_bytes = nb * kBlockBytes;
  const XRows<R> xr(a, row0, true);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F), top_mask = _mm512_set1_epi8(0x30);
  const bool fetch = prefetch_groups > 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c0 = codes0 + b * kBlockBytes;
    const uint8_t* c1 = codes1 + b * kBlockBytes;
    if (fetch) {
      _mm_prefetch(reinterpret_cast<const char*>(sc0.addr(2 * b + prefetch_groups)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sc1.addr(2 * b + prefetch_groups)), _MM_HINT_T0);
      const int64_t ahead = kAhead + (b * kBlockBytes + kAhead >= panel_bytes ? panel_bytes : 0);  // kAhead
      for (int64_t line = 0; line < kBlockBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(c0 + ahead + line), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(c1 + ahead + line), _MM_HINT_T1);
      }
    }
    __m512i raw[4];  // the nibble vectors: k = 4t + i (low), 16 + 4t + i (high)
    for (int t = 0; t < 4; ++t) raw[t] = pair_load(c0 + 32 * t, c1 + 32 * t);
    for (int h = 0; h < 2; ++h) {
      const int64_t g = 2 * b + h;
      const __m512i plane = pair_load(c0 + 128 + 32 * h, c1 + 128 + 32 * h);
      __m512i isum[R];
      for (int t = 0; t < 4; ++t) {
        // the top 2 bits (2t, 2t + 1 of each byte) to bits 4, 5, as panel_kernel_q6; then one VPTERNLOGD
        // makes (nibbles & 0x0F) | top
        const __m512i top = _mm512_and_si512(
            t < 2 ? _mm512_slli_epi16(plane, 4 - 2 * t) : t == 2 ? plane : _mm512_srli_epi16(plane, 2), top_mask);
        const __m512i w = _mm512_ternarylogic_epi32(h == 0 ? raw[t] : _mm512_srli_epi16(raw[t], 4), top, nibble, 0xEC);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xr.q[r] + b * kBlock + 16 * h + 4 * t;
          isum[r] = dot4_bcast(t == 0 ? _mm512_setzero_si512() : isum[r], w, x);
        }
      }
      const __m512 s = pair_ps(sc0.at(g), sc1.at(g));
      for (int r = 0; r < R; ++r) {
        const __m512i exact = _mm512_add_epi32(isum[r], _mm512_set1_epi32(xr.corr[r][g]));  // -32 x the code sum
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(xr.d[r][b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
      }
    }
  }
  store_pair(acc, R, res0, res1);
}

// pair_kernel (BITS 4, 8) or pair_kernel_q6 (BITS 6) for `rows` (1..kRows<BITS>) rows
template <int BITS, typename S, bool DERIVED, int R = 1>
inline void dispatch_pair_rows(int rows, const QuantizedX& a, int64_t row0, const uint8_t* codes0,
                               const uint8_t* codes1, S sc0, S sc1, S mn0, S mn1, float min_factor,
                               int64_t group_blocks, int64_t prefetch_groups, float (*res0)[kCols],
                               float (*res1)[kCols]) {
  if constexpr (R < kRows<BITS>) {
    if (rows != R)
      return dispatch_pair_rows<BITS, S, DERIVED, R + 1>(rows, a, row0, codes0, codes1, sc0, sc1, mn0, mn1,
                                                         min_factor, group_blocks, prefetch_groups, res0, res1);
  }
  if constexpr (BITS == 6)
    pair_kernel_q6<R, S>(a, row0, codes0, codes1, sc0, sc1, prefetch_groups, res0, res1);
  else
    pair_kernel<BITS, R, S, DERIVED>(a, row0, codes0, codes1, sc0, sc1, mn0, mn1, min_factor, group_blocks,
                                     prefetch_groups, res0, res1);
}

}  // namespace woq_avx2

#endif
