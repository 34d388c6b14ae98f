// Weight-only quantized matmul for AVX2 + FMA + F16C CPUs (every x86 tier below AMX): y = x @ W^T + bias
// with W = scales * q + mins per group of the input dimension, q 4- or 8-bit codes. Bound for Python in
// woq_avx2.cpp (quantization/avx2.py); a header so that a fused C++ stack can call matmul_into directly.
//
// How: the activations are quantized on the fly to int8 per 32-element block (llama.cpp's Q8_1 idea):
//     x_k ~ d_b * xq_k,  |xq_k| <= 127,  d_b = max|x| / 127 over block b,
// and each block's sum is kept, so a group of w = s q + m costs integer dot products and two FMAs:
//     sum_k x_k (s q_k + m) ~ s * d_b * sum_k q_k xq_k + m * (d_b * sum_k xq_k).
// Where the mins are c x the scales (GGUF's symmetric types: derived, below), w = s (q + c) with c an
// integer, so the min is taken in int32 instead, and the block costs one FMA:
//     sum_k x_k s (q_k + c) ~ s * d_b * (sum_k q_k xq_k + c * sum_k xq_k).
// The integer dot products run on VPMADDUBSW (u8 x s8 -> pairs summed in int16) + VPMADDWD (-> int32).
//
// Accuracy contract: the result is the float32 reference x.float() @ (s q + m)^T (+ bias) with x rounded
// to int8 per 32-block as above, and nothing else: every product and sum after that rounding is exact in
// int32, or float32 up to summation order. tests/test_woq_avx2.py asserts both halves for every case:
// relative Frobenius error < 1e-5 against the reference computed on x rounded the same way (5e-3 with bf16
// output), and < 1.5e-2 against the float32 reference with random normal x (typically 2e-3 to 7e-3; one
// value 100x the rest of its block included). The fp32-activation gemv below is < 1e-5 (kept for
// measurement, not used: slower). GGUF Q4_K's and Q6_K's two-level layouts, where no pairs kernel takes
// them, round x per 256-input super-block instead (llama.cpp's Q8_K; panel_kernel_span and
// panel_kernel_q6_span state that contract).
//
// Group 16 (8-bit codes only: GGUF Q6_K's sub-blocks): the scale and min change in the middle of a
// 32-input activation block, so the block's integer dot product is taken per 16-input half (vectors 0-3
// and 4-7 below) and so is the activation codes' sum (quantize_row keeps d * sum(codes) per 16 as well),
// each half then scaled by its own group's scale and min. x is rounded exactly as for the other groups
// (per 32-block), so the contract is the same: the float32 reference on x rounded per 32-block, exact in
// int32 up to the scaling and float32 up to summation order; the same bounds in tests/test_woq_avx2.py.
// Every group that is a multiple of 32 runs the code it ran before (same instructions, same results).
//
// Layout (avx2.pack): output columns in panels of 8 (N padded to a multiple of 8 with zero codes/scales),
// and within a panel each 32-k block is one contiguous run of codes:
//   4-bit, 128 bytes a block: 4 vectors of 32 bytes; in vector v, byte 4c + i holds column c's codes for
//          k = 4v + i (low nibble) and k = 16 + 4v + i (high nibble).
//   8-bit, 256 bytes a block: 8 vectors; in vector j, byte 4c + i holds (q - 128) as int8 for k = 4j + i.
//   scales, mins: [panels, groups, 8] float16 when float16 holds them exactly (GGUF), two-level for GGUF's
//          K-quant super-blocks (FlatScales / TwoLevelScales below), else float32. Where every min is one
//          power of two c times its scale (GGUF's symmetric types: Q4_0 c = -8, Q5_0 -16, Q6_K -32, Q8_0
//          -128) the layout keeps no mins, only c (mins_ref): 0.0625 B a weight less to stream for Q4_0.
// Why this order: one 32-bit broadcast of 4 activation bytes against a 32-byte vector gives the 8 columns'
// 4-term dot products in 8 separate int32 lanes (VPMADDUBSW then VPMADDWD), so no horizontal sums are ever
// needed and one unpacked weight vector is reused across up to 8 activation rows (kRows)
// (llama.cpp's repack.cpp interleaves 8 columns for the same reason). 4-bit codes are unsigned 0..15, so
// they are VPMADDUBSW's unsigned operand as they are; a pair sums to at most 2*15*127 = 3810 and a block's
// 8 products to 8 * 3810 = 30480 < 32767, so a whole block accumulates in int16 and widens once. 8-bit
// codes are stored as q - 128 (signed) and use the abs/sign trick: |w| (<= 128, unsigned) times
// sign(w) * xq, a pair at most 2*128*127 = 32512, so each product widens to int32 at once.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace woq_avx2 {

constexpr int64_t kCols = 8;        // output columns a panel
constexpr int64_t kBlock = 32;      // inputs an activation block (and the smallest group, kHalfGroup aside)
constexpr int64_t kHalfGroup = 16;  // 8-bit codes also take groups of half a block (panel_kernel_g16)
// Activation rows a micro-kernel runs against each unpacked weight vector: the unpacking (and for 8-bit
// the |w|), the scale and min loads and the loop are shared by that many rows. One thread, CPU time,
// GFLOP/s at M = 32 / 256 (576 -> 3072 Q4_1; 576 -> 8192 Q8_0):
//     4-bit  R=4 123 / 122   R=6 119 / 115   R=8 136 / 133
//     8-bit  R=4  88 /  89   R=6  98 / 102   R=8  94 /  98
// (8 rows' accumulators and the 8 unpacked vectors do not all fit in 16 registers; it still pays.)
template <int BITS>
constexpr int kRows = BITS == 4 ? 8 : 6;
// bytes of one panel's 32-input block: 4-bit 128, 6-bit (Q6_K, group 16 only) 192, 8-bit 256
constexpr int64_t block_bytes(int64_t bits) { return bits * 32; }
constexpr int kMaxRows = 8;  // the largest kRows

// Decode-time weights come from DRAM and one call is too short for the hardware prefetcher to ramp up, so
// the loop asks for codes this far ahead (woq_gemv.h found 2 KB worth 2x on the AMX tier). Measured here,
// the default model's 121 calls at M=1 on one thread (CPU time, median of 15, Zen 3 VM at load average 7):
// none 11.0 ms, 1 KB 9.8, 2 KB 9.4, 4 KB 9.3. Two-thread wall times were all noise at that load.
#ifndef WOQ_AVX2_PREFETCH
#define WOQ_AVX2_PREFETCH 2048
#endif
constexpr int64_t kPrefetchBytes = WOQ_AVX2_PREFETCH;
// For many rows, each thread works through strips of panels whose codes fit in L2 (~this many bytes),
// running every kRows-row block of x over a strip before the next: the weights are unpacked from L1/L2
// and each block of quantized rows (kRows * K bytes) stays in L1 across the strip's panels. The size
// hardly matters (16 / 48 / 192 KB, 4 rows a block: 119-126 GFLOP/s a core at M = 32-1024): the kernel is
// bound by instructions, not data.
#ifndef WOQ_AVX2_STRIP
#define WOQ_AVX2_STRIP (48 * 1024)
#endif
constexpr int64_t kStripBytes = WOQ_AVX2_STRIP;

template <typename S>
inline __m256 load8(const S* p);
template <>
inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 load8<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

// 4 bytes of activations broadcast to the 8 lanes (one VPBROADCASTD from memory)
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Where the tier has AVX512-VNNI (avx512_bf16 and up: platform.py), VPDPBUSD does a VPMADDUBSW +
// VPMADDWD + VPADDD in one instruction, its 4-term sums going straight into int32 lanes. The int32 results
// are the same wherever VPMADDUBSW's int16 pair sums cannot saturate, which the operand ranges of every
// caller guarantee (header comment), so both builds give the same results bit for bit.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define WOQ_VNNI 1
#endif

// acc + the 4-term dot products of u's unsigned and s's signed bytes, per int32 lane
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef WOQ_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// the same without an accumulator
inline __m256i dot4(__m256i u, __m256i s) {
#ifdef WOQ_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// A 4-bit block's 8 weight vectors from its 128 bytes: vector v (0..3) the low nibbles (k = 4v + i), v + 4
// the high ones (k = 16 + 4v + i), as unsigned bytes 0..15.
[[gnu::always_inline]] inline void unpack4(const uint8_t* c, __m256i nibble, __m256i (&w)[8]) {
  for (int v = 0; v < 4; ++v) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * v));
    w[v] = _mm256_and_si256(raw, nibble);
    w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  }
}

// Group h (0, 1: k 0..15, 16..31) of a 6-bit (Q6_K) block's 192 bytes as 4 weight vectors of codes 0..63:
// vector t holds k = 16h + 4t + i, its low 4 bits from nibble vector t (low nibbles for h = 0, high for h = 1),
// its top 2 from plane h's bits 2t, 2t + 1, moved to bits 4, 5 by one shift in 16-bit lanes and a mask (what
// crosses into the neighbouring byte lands outside bits 4, 5).
[[gnu::always_inline]] inline void unpack6(const uint8_t* c, int h, __m256i (&w)[4]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top_mask = _mm256_set1_epi8(0x30);
  const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 128 + 32 * h));
  for (int t = 0; t < 4; ++t) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * t));
    const __m256i low = _mm256_and_si256(h == 0 ? raw : _mm256_srli_epi16(raw, 4), nibble);
    const __m256i top = _mm256_and_si256(
        t < 2 ? _mm256_slli_epi16(plane, 4 - 2 * t) : t == 2 ? plane : _mm256_srli_epi16(plane, 2), top_mask);
    w[t] = _mm256_or_si256(low, top);
  }
}

// The scales (or the mins) of a layer in one of avx2.pack's three forms, read group by group:
//   float32 or float16 [panels, groups, 8]: one value a group and column (float16 where it holds them all
//            exactly, as GGUF's d and m do);
//   two-level [panels, groups / sb, 16 + 8 sb] bytes (GGUF's K-quant super-blocks, sb groups each): per
//            super-block 8 float16 super-scales (one a column, as the file stores d and dmin), then sb x 8
//            int8 codes; a group's value is super-scale * code, which the pack verified to be exact in
//            float32, so the kernel reads the same numbers as from the float32 form at 4.625 bits a weight for
//            Q4_K instead of 6 (and 6.56 for Q6_K, mins derived): decode streams the weights, so bytes are time.
// `panel(p, groups)` moves to panel p; `at(g)` gives group g's 8 values; `addr(g)` is for prefetching.
template <typename T>
struct FlatScales {
  const T* p;
  [[gnu::always_inline]] __m256 at(int64_t g) const { return load8(p + g * kCols); }
  const void* addr(int64_t g) const { return p + g * kCols; }
  FlatScales panel(int64_t i, int64_t groups) const { return {p + i * groups * kCols}; }
};

struct TwoLevelScales {
  const uint8_t* p;
  int shift;       // log2 of the groups a super-block (sb)
  int64_t stride;  // bytes a super-block: 16 + 8 sb
  [[gnu::always_inline]] __m256 at(int64_t g) const {
    const uint8_t* block = p + (g >> shift) * stride;
    const int8_t* codes = reinterpret_cast<const int8_t*>(block + 16 + (g & ((int64_t(1) << shift) - 1)) * kCols);
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block))), c);
  }
  const void* addr(int64_t g) const { return p + (g >> shift) * stride; }
  TwoLevelScales panel(int64_t i, int64_t groups) const { return {p + i * (groups >> shift) * stride, shift, stride}; }
};

// A layer's scales or mins as the tensors hold them: the form (its dtype says which) and, for two-level,
// the super-block's shape (from the tensor's last dimension).
struct ScaleRef {
  enum Form { kF32, kF16, kTwoLevel } form;
  const void* p;
  int shift = 0;
  int64_t stride = 0;
  float factor = 0.f;  // mins only: nonzero where the layout keeps none and they are factor x the scales
};

inline ScaleRef scale_ref(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return {ScaleRef::kF32, t.data_ptr()};
  if (t.scalar_type() == at::kHalf) return {ScaleRef::kF16, t.data_ptr()};
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 3 && t.size(2) > 16 && (t.size(2) - 16) % kCols == 0,
              "woq_avx2: two-level scales must be uint8 [panels, super-blocks, 16 + 8 sb]");
  const int64_t sb = (t.size(2) - 16) / kCols;
  TORCH_CHECK(sb > 0 && (sb & (sb - 1)) == 0, "woq_avx2: a super-block's groups must be a power of two");
  int shift = 0;
  while ((int64_t(1) << shift) < sb) ++shift;
  return {ScaleRef::kTwoLevel, t.data_ptr(), shift, t.size(2)};
}

// The mins as the layout keeps them: their own tensor, or (one float32 element c: GGUF's symmetric types,
// Q4_0 -8, Q5_0 -16, Q6_K -32, Q8_0 -128) none, each group's min c x its scale, exact for a power of two.
inline ScaleRef mins_ref(const at::Tensor& mins, const ScaleRef& scales) {
  if (mins.numel() != 1) return scale_ref(mins);
  TORCH_CHECK(mins.scalar_type() == at::kFloat, "woq_avx2: a derived mins factor must be one float32 element");
  ScaleRef r = scales;
  r.factor = mins.item<float>();
  TORCH_CHECK(r.factor != 0.f && r.factor == float(int32_t(r.factor)) && std::abs(r.factor) <= 128.f,
              "woq_avx2: a derived mins factor must be a nonzero integer in [-128, 128]");
  return r;
}

// fn(scales, mins) with both as their accessor type (the two are always of one form: avx2.pack).
template <typename Fn>
inline void with_scales(const ScaleRef& sc, const ScaleRef& mn, Fn&& fn) {
  TORCH_CHECK(sc.form == mn.form && sc.stride == mn.stride, "woq_avx2: scales and mins must be of one form");
  if (sc.form == ScaleRef::kF32)
    fn(FlatScales<float>{static_cast<const float*>(sc.p)}, FlatScales<float>{static_cast<const float*>(mn.p)});
  else if (sc.form == ScaleRef::kF16)
    fn(FlatScales<at::Half>{static_cast<const at::Half*>(sc.p)},
       FlatScales<at::Half>{static_cast<const at::Half*>(mn.p)});
  else
    fn(TwoLevelScales{static_cast<const uint8_t*>(sc.p), sc.shift, sc.stride},
       TwoLevelScales{static_cast<const uint8_t*>(mn.p), mn.shift, mn.stride});
}

// One row of x (float32 or bf16, K a multiple of 32) -> int8 codes q [K], block scales d [K/32] and
// d * (sum of the block's codes) ds [K/32]; with ds16 (else nullptr) also d * (sum of each 16-half's codes)
// ds16 [K/16], for group 16. Integer code sums where asked: 128 x each block's in qs128 [K/32], and c x each
// block's (each 16-half's where ds16 is given) in corr [K/32 or K/16], for derived mins c x the scales.
// Round to nearest even (VCVTPS2DQ); an all-zero block gets d = 0.
// The min term m * sum(x) takes d * sum(codes), the same rounded x as s * sum(q x): then the result is
// exactly sum(w * x_rounded), and where s q and m nearly cancel (Q4_1, m ~ -8 s) their rounding errors
// cancel too. Tried: the block's exact float sum for the min term, which left s * sum(q * error) uncancelled
// (bf16 GGUF logits against the dequantized model moved from mean 0.52 to past 0.8, greedy changed).
template <typename T>
inline void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* ds, float* ds16 = nullptr,
                         int32_t* qs128 = nullptr, int32_t* corr = nullptr, int32_t c = 0) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = load8(x + b * kBlock + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    const float am = hmax(amax);
    const __m256 inv = _mm256_set1_ps(am > 0.f ? 127.f / am : 0.f);
    __m256i i[4];
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      sum = _mm256_add_epi32(sum, i[j]);
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_permutevar8x32_epi32(p, order));
    const float scale = am / 127.f;
    d[b] = scale;
    const int32_t code_sum = hsum(sum);
    ds[b] = scale * float(code_sum);
    if (qs128) qs128[b] = 128 * code_sum;
    if (ds16) {  // v[0], v[1] are k 0..15 of the block, v[2], v[3] k 16..31
      const int32_t lo = hsum(_mm256_add_epi32(i[0], i[1])), hi = hsum(_mm256_add_epi32(i[2], i[3]));
      ds16[2 * b] = scale * float(lo);
      ds16[2 * b + 1] = scale * float(hi);
      if (corr) corr[2 * b] = c * lo, corr[2 * b + 1] = c * hi;
    } else if (corr) {
      corr[b] = c * code_sum;
    }
  }
}

// One row of x -> int8 codes q [K] rounded per span (a K-quant super-block, 256 inputs: llama.cpp's Q8_K),
// the span's scale d [K/span], and the code sums bsum of each 32-block [K/32] (Q4_K's groups), or with per16
// of each 16 inputs [K/16] (Q6_K's groups); |sum| <= 32 * 127: int16. The same rounding as quantize_row
// (scale max|x| / 127, nearest even), over a span instead of 32 inputs.
template <typename T>
inline void quantize_row_span(const T* x, int64_t K, int64_t span, int8_t* q, float* d, int16_t* bsum,
                              bool per16 = false) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t s = 0; s < K / span; ++s) {
    const T* xs = x + s * span;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < span; k += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8(xs + k), abs_mask));
    const float am = hmax(amax);
    const __m256 inv = _mm256_set1_ps(am > 0.f ? 127.f / am : 0.f);
    d[s] = am / 127.f;
    for (int64_t b = 0; b < span / kBlock; ++b) {
      __m256i i[4];
      for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xs + b * kBlock + 8 * j), inv));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + s * span + b * kBlock), _mm256_permutevar8x32_epi32(p, order));
      const int64_t blk = s * (span / kBlock) + b;
      if (per16) {  // i[0], i[1] are inputs 0..15 of the block, i[2], i[3] 16..31
        bsum[2 * blk] = int16_t(hsum(_mm256_add_epi32(i[0], i[1])));
        bsum[2 * blk + 1] = int16_t(hsum(_mm256_add_epi32(i[2], i[3])));
      } else {
        bsum[blk] = int16_t(hsum(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]))));
      }
    }
  }
}

// x quantized per 32-block: codes [M, K], scales and scaled sums [M, K/32]; for group 16 the scaled sums
// per 16 [M, K/16] (else nullptr)
struct QuantizedX {
  const int8_t* q;
  const float* d;
  const float* ds;
  int64_t K;
  const float* ds16 = nullptr;
  const int32_t* qs128 = nullptr;  // 128 x each block's code sum [M, K/32]: 8-bit kernels (below)
  const int32_t* corr = nullptr;   // derived mins: c x each block's code sum [M, K/32] ([M, K/16] for group 16)
  // x rounded per super-block (panel_kernel_span, panel_kernel_q6_span): d is then one scale a span
  // [M, K/span], and bsum the code sums of each group, 32-block [M, K/32] (Q4_K) or 16 inputs [M, K/16]
  // (Q6_K); nullptr where x is rounded per 32-block
  const int16_t* bsum = nullptr;
};

// Rows row0..row0 + R - 1 of the quantized x as every micro-kernel reads them: codes, block scales, the
// scaled code sums per 32-block (a.ds), or per 16 (a.ds16) for group 16, and the derived mins' integer
// corrections (a.corr, per 32 or per 16 alike; a.qs128 per 32).
template <int R>
struct XRows {
  const int8_t* q[R];
  const float* d[R];
  const float* ds[R];
  const int32_t* corr[R];
  const int32_t* qs128[R];
  XRows(const QuantizedX& a, int64_t row0, bool per16) {
    const int64_t nb = a.K / kBlock, per = per16 ? 2 * nb : nb;
    for (int r = 0; r < R; ++r) {
      q[r] = a.q + (row0 + r) * a.K;
      d[r] = a.d + (row0 + r) * nb;
      ds[r] = per16 ? a.ds16 + (row0 + r) * 2 * nb : a.ds + (row0 + r) * nb;
      corr[r] = a.corr ? a.corr + (row0 + r) * per : nullptr;
      qs128[r] = a.qs128 ? a.qs128 + (row0 + r) * nb : nullptr;
    }
  }
};

// R rows (row0..row0+R-1) of x times one panel of 8 columns over the whole K, into res[R][8] (float32,
// no bias). Per block and row: 8 VPMADDUBSW + 7 adds + 1 VPMADDWD (4-bit) then a convert, a multiply and 2
// FMAs; the unpacking (3 ops a weight vector) is shared by the R rows. That is near the floor for AVX2
// without VNNI (32 products a VPMADDUBSW, each needing an add to be reduced), and the kernel is bound by
// the count of vector instructions: on one core it runs ~135 GFLOP/s (4-bit) at M >= 32 against MKL's
// float32 ~80. Measured alternatives (one thread, CPU time): dropping the float32 per-block work (timing only,
// wrong results) ran 1.45x faster, so the scale and min per 32-block are what is left to pay; replacing
// VPMADDWD by shifts and adds was slower (118 -> 106 GFLOP/s); the rows interleaved quad by quad instead
// of one chain a row, the same speed; 32-byte loads instead of the 4-byte broadcasts, the same.
// DERIVED: the mins are c x the scales (mins_ref), not read: each block's int32 sum takes c x the code sum
// (a.corr), and 8-bit codes' 128 x it (a.qs128: they are stored as q - 128), so w = s (q + c) costs one FMA.
// A template parameter, not a test in the loop: the per-group branch cost 3% of a W32 decode step of the
// default model (ab_decode_stack.py).
template <int BITS, int R, typename S, bool DERIVED>
inline void panel_kernel(const QuantizedX& a, int64_t row0, const uint8_t* codes, S sc, S mn, float,
                         int64_t group_blocks, int64_t prefetch_groups, float (*res)[kCols]) {
  constexpr int64_t kBlockBytes = BITS == 4 ? 128 : 256;
  const int64_t K = a.K, nb = K / kBlock, groups = nb / group_blocks;
  const XRows<R> xr(a, row0, false);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(sc.addr(g + prefetch_groups)), _MM_HINT_T0);
    if constexpr (!DERIVED) _mm_prefetch(reinterpret_cast<const char*>(mn.addr(g + prefetch_groups)), _MM_HINT_T0);
    const __m256 s = sc.at(g);
    [[maybe_unused]] __m256 m;
    if constexpr (!DERIVED) {
      m = mn.at(g);
      // 8-bit codes are stored as q - 128: s q + m = s (q - 128) + (m + 128 s)
      if constexpr (BITS == 8) m = _mm256_fmadd_ps(_mm256_set1_ps(128.f), s, m);
    }
    for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
      const uint8_t* c = codes + b * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T0);
      __m256i isum[R];
      if constexpr (BITS == 4) {
        // the block's 8 unpacked weight vectors stay in registers while each row runs its 8 products
        // into one int16 chain (an earlier row-interleaved form let GCC build an add tree and spill)
        __m256i w[8];
        unpack4(c, nibble, w);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xr.q[r] + b * kBlock;
#ifdef WOQ_VNNI
          __m256i p = dot4(w[0], bcast4(x));
          for (int j = 1; j < 8; ++j) p = dot4(p, w[j], bcast4(x + 4 * j));
          isum[r] = p;
#else
          __m256i p = _mm256_maddubs_epi16(w[0], bcast4(x));
          for (int j = 1; j < 8; ++j) {
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
            asm("" : "+x"(p));  // keep the chain: no reassociation into a tree of spilled products
          }
          isum[r] = _mm256_madd_epi16(p, ones);
#endif
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
          const __m256i aw = _mm256_abs_epi8(w);
          for (int r = 0; r < R; ++r) {
            const __m256i xs = _mm256_sign_epi8(bcast4(xr.q[r] + b * kBlock + 4 * j), w);
            isum[r] = j == 0 ? dot4(aw, xs) : dot4(isum[r], aw, xs);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        if constexpr (DERIVED)
          isum[r] = _mm256_add_epi32(isum[r], _mm256_set1_epi32(xr.corr[r][b] + (BITS == 8 ? xr.qs128[r][b] : 0)));
        const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xr.d[r][b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
        if constexpr (!DERIVED) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xr.ds[r][b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(res[r], acc[r]);
}

// panel_kernel for group 16 (8-bit codes only: GGUF Q6_K), two groups a block. The int32 sums of vectors
// 0-3 (k 0..15) are scaled with the first group's scale and min (and the first half's code sum) as soon as
// they are complete, then vectors 4-7 start fresh sums for the second group: the same registers, and a
// convert, a multiply and two FMAs more a block and row than panel_kernel<8>.
template <int R, typename S, bool DERIVED>
inline void panel_kernel_g16(const QuantizedX& a, int64_t row0, const uint8_t* codes, S sc, S mn,
                             float min_factor, int64_t prefetch_groups, float (*res)[kCols]) {
  constexpr int64_t kBlockBytes = 256;
  const int64_t K = a.K, nb = K / kBlock;
  const XRows<R> xr(a, row0, true);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256 k128 = _mm256_set1_ps(128.f), factor = _mm256_set1_ps(min_factor);
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(sc.addr(2 * b + prefetch_groups)), _MM_HINT_T0);
    if constexpr (!DERIVED)
      _mm_prefetch(reinterpret_cast<const char*>(mn.addr(2 * b + prefetch_groups)), _MM_HINT_T0);
    const uint8_t* c = codes + b * kBlockBytes;
    for (int64_t line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T0);
    __m256i isum[R];
    for (int h = 0; h < 2; ++h) {
      const int64_t g = 2 * b + h;
      for (int j = 4 * h; j < 4 * h + 4; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i xs = _mm256_sign_epi8(bcast4(xr.q[r] + b * kBlock + 4 * j), w);
          isum[r] = j == 4 * h ? dot4(aw, xs) : dot4(isum[r], aw, xs);
        }
      }
      // 8-bit codes are stored as q - 128: s q + m = s (q - 128) + (m + 128 s)
      const __m256 s = sc.at(g);
      const __m256 m = _mm256_fmadd_ps(k128, s, DERIVED ? _mm256_mul_ps(s, factor) : mn.at(g));
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xr.d[r][b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xr.ds[r][g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(res[r], acc[r]);
}

// GGUF Q6_K with its codes in 6 bits, group 16 (what panel_kernel_g16 runs on 8-bit codes, at 3/4 of the
// bytes: decode streams the weights, so bytes are time), and no mins read: Q6_K's are -32 x its scales, a
// multiply by a power of two (exact), so the layout stores none (`mn` is never read): the int32 sums take -32 x
// the code sums (a.corr), as panel_kernel's derived mins. A block's 192 bytes a panel: the 4-bit layout's 4
// nibble vectors (vector v: k = 4v + i low, k = 16 + 4v + i high), then two vectors of the codes' top 2 bits:
// byte 4c + i of plane h holds those of k = 16h + 4t + i in bits 2t, 2t + 1 (t = 0..3). The codes 0..63 are
// VPMADDUBSW's unsigned operand as they are (a pair at most 2 * 63 * 127 = 16002 < 32767), so no q - 128
// shift: s q + m with the file's m = -32 s. The integer sums are the 8-bit path's exactly; the float steps
// apply m rather than m + 128 s, so results agree within float32 rounding, not bit for bit.
template <int R, typename S>
inline void panel_kernel_q6(const QuantizedX& a, int64_t row0, const uint8_t* codes, S sc, S, float,
                            int64_t prefetch_groups, float (*res)[kCols]) {
  constexpr int64_t kBlockBytes = block_bytes(6);
  const int64_t K = a.K, nb = K / kBlock;
  const XRows<R> xr(a, row0, true);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(sc.addr(2 * b + prefetch_groups)), _MM_HINT_T0);
    const uint8_t* c = codes + b * kBlockBytes;
    for (int64_t line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const int64_t g = 2 * b + h;
      __m256i w[4];
      unpack6(c, h, w);
      __m256i isum[R];
      for (int t = 0; t < 4; ++t) {
        for (int r = 0; r < R; ++r) {
          const __m256i x = bcast4(xr.q[r] + b * kBlock + 16 * h + 4 * t);
          isum[r] = t == 0 ? dot4(w[t], x) : dot4(isum[r], w[t], x);
        }
      }
      const __m256 s = sc.at(g);
      for (int r = 0; r < R; ++r) {
        const __m256i exact = _mm256_add_epi32(isum[r], _mm256_set1_epi32(xr.corr[r][g]));
        const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xr.d[r][b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(res[r], acc[r]);
}

// Rows row0..row0 + R - 1 of x rounded per super-block (quantize_row_span): codes q, the spans' scales d,
// and the groups' code sums (`sums` a row); zeroes res[R], which the span kernels accumulate into.
template <int R>
struct SpanRows {
  const int8_t* q[R];
  const float* d[R];
  const int16_t* sums[R];
  SpanRows(const QuantizedX& a, int64_t row0, int64_t spans, int64_t per_row, float (*res)[kCols]) {
    for (int r = 0; r < R; ++r) {
      q[r] = a.q + (row0 + r) * a.K;
      d[r] = a.d + (row0 + r) * spans;
      sums[r] = a.bsum + (row0 + r) * per_row;
      _mm256_storeu_ps(res[r], _mm256_setzero_ps());
    }
  }
};

// A super-block's G int8 codes a column (its groups' scale or min codes as the two-level layout keeps them,
// [G][8] bytes), groups 2j and 2j + 1 as int16 pairs column by column; dot(sums) is sum_g code_g x sums[g]
// in column c's int32 lane for a row's G int16 code sums of x (G / 2 VPMADDWD): a super-block's integer
// term over its groups, once a super-block and row.
template <int G>
struct CodePairs {
  __m256i pairs[G / 2];
  explicit CodePairs(const uint8_t* codes) {
    for (int j = 0; j < G / 2; ++j) {
      const __m128i two = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * j * kCols));
      pairs[j] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(two, _mm_srli_si128(two, 8)));
    }
  }
  [[gnu::always_inline]] __m256i dot(const int16_t* sums) const {
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < G / 2; ++j) {
      int32_t two;  // groups 2j and 2j + 1's sums, int16 each
      std::memcpy(&two, sums + 2 * j, sizeof two);
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs[j], _mm256_set1_epi32(two)));
    }
    return acc;
  }
};

// panel_kernel for GGUF Q4_K (4-bit codes, two-level scales and mins, 8 groups of 32 a super-block) with x
// rounded per super-block (quantize_row_span: llama.cpp's Q8_K activations). x then has one scale over the
// super-block, so its groups' integer dot products add up in int32 before any float work: each group's
// VPMADDUBSW pair sums go through VPMADDWD against the group's scale codes (the 8 columns' int8 codes, each
// in both int16 halves of its column's lane) where panel_kernel multiplies by ones, and the float work (a
// convert, a multiply, an FMA for the scales; the same for the mins) is paid once a super-block instead of
// once a group: on AVX2 that work shares ports 0 and 1 with VPMADDUBSW, and panel_kernel spends 4 of its
// ~13 port-0/1 instructions a block and row on it. The mins' term sum_g m_g sum(x_g) is integer too: the min
// codes of groups 2j and 2j + 1 interleaved as int16 pairs, VPMADDWD against the two blocks' code sums.
// Bounds: a group's int16 chain at most 8 x 2 x 15 x 127 = 30480 (as panel_kernel's); times a code (|c| <=
// 127) and summed over the 8 groups in int32 (< 2^26); a block's code sum |.| <= 4064.
// Accuracy contract: the float32 reference on x rounded per super-block (256 inputs for Q4_K) instead of per
// 32-block: exact in int32, then float32 rounding (tests/test_gguf_blocks.py's two-level test: < 1e-5).
constexpr int64_t kSpanGroups = 8;  // Q4_K: 8 groups of 32 a super-block
template <int R>
inline void panel_kernel_span(const QuantizedX& a, int64_t row0, const uint8_t* codes, TwoLevelScales sc,
                              TwoLevelScales mn, int64_t prefetch_groups, float (*res)[kCols]) {
  constexpr int64_t sb = kSpanGroups;
  const int64_t nb = a.K / kBlock, spans = nb / sb;
  const SpanRows<R> xr(a, row0, spans, nb, res);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t t = 0; t < spans; ++t) {
    const uint8_t* s_block = sc.p + t * sc.stride;
    const uint8_t* m_block = mn.p + t * mn.stride;
    _mm_prefetch(reinterpret_cast<const char*>(sc.addr((t << sc.shift) + prefetch_groups)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mn.addr((t << sc.shift) + prefetch_groups)), _MM_HINT_T0);
    __m256i isum[R];
    for (int64_t gi = 0; gi < sb; ++gi) {
      const int64_t b = t * sb + gi;
      const uint8_t* c = codes + b * 128;
      for (int64_t line = 0; line < 128; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T0);
      // the group's 8 scale codes, column c's in int16 lanes 2c and 2c + 1 (its pair sums' lanes)
      const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s_block + 16 + gi * kCols));
      const __m256i scale_codes = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c8, c8));
      __m256i w[8];
      unpack4(c, nibble, w);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xr.q[r] + b * kBlock;
        __m256i p = _mm256_maddubs_epi16(w[0], bcast4(x));
        for (int j = 1; j < 8; ++j) {
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
          asm("" : "+x"(p));  // keep the chain (panel_kernel)
        }
        const __m256i scaled = _mm256_madd_epi16(p, scale_codes);
        isum[r] = gi == 0 ? scaled : _mm256_add_epi32(isum[r], scaled);
      }
    }
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s_block)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_block)));
    const CodePairs<kSpanGroups> min_codes(m_block + 16);
    for (int r = 0; r < R; ++r) {
      const __m256i msum = min_codes.dot(xr.sums[r] + t * kSpanGroups);
      const __m256 dx = _mm256_set1_ps(xr.d[r][t]);
      __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(s, dx), _mm256_loadu_ps(res[r]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(m, dx), acc);
      _mm256_storeu_ps(res[r], acc);
    }
  }
}

// panel_kernel_q6 with x rounded per super-block (quantize_row_span, per-16 code sums), as panel_kernel_span
// does for Q4_K: a Q6_K super-block's 16 groups of 16 add up in int32 and the float work is paid once per 256
// inputs instead of once per 16. A group's 4 VPMADDUBSW pair sums (codes 0..63 unsigned: |pair| <= 2 x 63
// x 127 = 16002) go as two int16 sums of two (<= 32004) through VPMADDWD against the group's scale codes;
// the file's -32 offset (w = d sc (q - 32)) is the integer term -32 sum_g sc_g sum(x_g), the scale codes of
// groups 2j and 2j + 1 as int16 pairs against the two groups' code sums. Bounds: |sum_g sc_g sum(q x)| <=
// 16 x 128 x 16 x 63 x 127 < 2^28, the offset's term <= 32 x 16 x 128 x 16 x 127 < 2^28: int32.
// Accuracy contract: as panel_kernel_span's (the float32 reference on x rounded per 256 inputs).
constexpr int64_t kQ6SpanBlocks = 8;  // Q6_K: 8 blocks of 32 (16 groups of 16) a super-block
template <int R>
inline void panel_kernel_q6_span(const QuantizedX& a, int64_t row0, const uint8_t* codes, TwoLevelScales sc,
                                 int64_t prefetch_groups, float (*res)[kCols]) {
  constexpr int64_t kBlockBytes = block_bytes(6), groups = 2 * kQ6SpanBlocks;
  const int64_t nb = a.K / kBlock, spans = nb / kQ6SpanBlocks;
  const SpanRows<R> xr(a, row0, spans, 2 * nb, res);
  for (int64_t t = 0; t < spans; ++t) {
    const uint8_t* s_block = sc.p + t * sc.stride;
    _mm_prefetch(reinterpret_cast<const char*>(sc.addr((t << sc.shift) + prefetch_groups)), _MM_HINT_T0);
    __m256i isum[R];
    for (int64_t bi = 0; bi < kQ6SpanBlocks; ++bi) {
      const int64_t b = t * kQ6SpanBlocks + bi;
      const uint8_t* c = codes + b * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {  // the block's two groups (panel_kernel_q6's layout)
        const int64_t gi = 2 * bi + h;
        __m256i w[4];
        unpack6(c, h, w);
        // the group's 8 scale codes, column c's in int16 lanes 2c and 2c + 1 (panel_kernel_span)
        const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s_block + 16 + gi * kCols));
        const __m256i scale_codes = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c8, c8));
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xr.q[r] + b * kBlock + 16 * h;
          const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast4(x)),
                                              _mm256_maddubs_epi16(w[1], bcast4(x + 4)));
          const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast4(x + 8)),
                                              _mm256_maddubs_epi16(w[3], bcast4(x + 12)));
          const __m256i scaled = _mm256_add_epi32(_mm256_madd_epi16(lo, scale_codes), _mm256_madd_epi16(hi, scale_codes));
          isum[r] = gi == 0 ? scaled : _mm256_add_epi32(isum[r], scaled);
        }
      }
    }
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s_block)));
    const CodePairs<groups> scale_codes(s_block + 16);
    for (int r = 0; r < R; ++r) {
      const __m256i osum = scale_codes.dot(xr.sums[r] + t * groups);
      const __m256i exact = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(osum, 5));  // - 32 x the offset term
      const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xr.d[r][t]));
      _mm256_storeu_ps(res[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, _mm256_loadu_ps(res[r])));
    }
  }
}

// panel_kernel (panel_kernel_g16 for HALF: group 16) for `rows` (1..kRows<BITS>) rows
template <int BITS, typename S, bool HALF, bool DERIVED, int R = 1>
inline void dispatch_rows(int rows, const QuantizedX& a, int64_t row0, const uint8_t* codes, S sc,
                          S mn, float min_factor, int64_t group_blocks, int64_t prefetch_groups,
                          float (*res)[kCols]) {
  if constexpr (R < kRows<BITS>) {
    if (rows != R)
      return dispatch_rows<BITS, S, HALF, DERIVED, R + 1>(rows, a, row0, codes, sc, mn, min_factor, group_blocks,
                                                 prefetch_groups, res);
  }
  if constexpr (std::is_same_v<S, TwoLevelScales> && BITS == 4 && !HALF && !DERIVED) {
    // kRows<4> rows at once here too (alternated on the Xeon here, 4 rows a call were no faster)
    if (a.bsum) return panel_kernel_span<R>(a, row0, codes, sc, mn, prefetch_groups, res);
  }
  if constexpr (std::is_same_v<S, TwoLevelScales> && HALF && BITS == 6) {
    if (a.bsum) return panel_kernel_q6_span<R>(a, row0, codes, sc, prefetch_groups, res);
  }
  if constexpr (HALF && BITS == 6)
    panel_kernel_q6<R, S>(a, row0, codes, sc, mn, min_factor, prefetch_groups, res);
  else if constexpr (HALF)
    panel_kernel_g16<R, S, DERIVED>(a, row0, codes, sc, mn, min_factor, prefetch_groups, res);
  else
    panel_kernel<BITS, R, S, DERIVED>(a, row0, codes, sc, mn, min_factor, group_blocks, prefetch_groups, res);
}

// float32 -> bf16, round to nearest even (as torch's .to(bfloat16), NaN aside)
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// res[R][8] (+ bias) into out rows row0.., columns 8p..: a full panel with vector stores, the last one's
// valid columns one by one.
template <typename T>
inline void store_tile(const float (*res)[kCols], int R, int64_t row0, int64_t p, const float* bias, int64_t N,
                       T* out) {
  const int64_t n0 = p * kCols, width = std::min<int64_t>(kCols, N - n0);
  for (int r = 0; r < R; ++r) {
    T* o = out + (row0 + r) * N + n0;
    if (width == kCols) {
      __m256 v = _mm256_loadu_ps(res[r]);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0));
      if constexpr (std::is_same_v<T, float>)
        _mm256_storeu_ps(o, v);
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16(v));
    } else {
      for (int64_t c = 0; c < width; ++c) o[c] = T(res[r][c] + (bias ? bias[n0 + c] : 0.f));
    }
  }
}

}  // namespace woq_avx2

// pair_kernel, pair_kernel_q6: two panels at a time in 512-bit registers where the build has AVX512-VNNI (WOQ_PAIRS)
#include "woq_avx512_pairs.h"

namespace woq_avx2 {

#ifdef WOQ_PAIRS
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

// whether run_panels takes a layer's panels in pairs: 4- and 8-bit codes in groups of 32 or more, Q6_K's 6-bit
constexpr bool paired(int64_t bits, bool half) { return kPairs && (bits == 6 ? half : !half); }

// Panels [p_begin, p_end) for all M rows: strip by strip (kStripBytes of codes), every kRows-row block of x
// over a strip before the next. HALF: group 16 (8-bit codes), two groups a block. Panels go two at a time
// where paired() says so (a strip then holds an even count, at least 2).
template <int BITS, typename S, typename T, bool HALF, bool DERIVED>
void run_panels(const QuantizedX& a, int64_t M, const uint8_t* codes, S sc, S mn, float min_factor,
                int64_t group_size, const float* bias, int64_t N, T* out, int64_t p_begin, int64_t p_end) {
  constexpr int64_t kBlockBytes = block_bytes(BITS);
  constexpr bool kPaired = paired(BITS, HALF);
  const int64_t nb = a.K / kBlock, groups = a.K / group_size, group_blocks = HALF ? 1 : group_size / kBlock;
  const int64_t panel_bytes = nb * kBlockBytes;
  const int64_t strip = kPaired ? std::max<int64_t>(2, kStripBytes / panel_bytes) & ~int64_t(1)
                                : std::max<int64_t>(1, kStripBytes / panel_bytes);
  const int64_t prefetch_groups =
      HALF ? 2 * (kPrefetchBytes / kBlockBytes) : std::max<int64_t>(1, kPrefetchBytes / kBlockBytes / group_blocks);
  alignas(32) float res[kMaxRows][kCols];
  [[maybe_unused]] alignas(32) float res_hi[kMaxRows][kCols];
  for (int64_t ps = p_begin; ps < p_end; ps += strip) {
    const int64_t pe = std::min(ps + strip, p_end);
    for (int64_t r0 = 0; r0 < M; r0 += kRows<BITS>) {
      const int R = int(std::min<int64_t>(kRows<BITS>, M - r0));
      int64_t p = ps;
#ifdef WOQ_PAIRS
      if constexpr (kPaired)
        for (; p + 1 < pe; p += 2) {
          dispatch_pair_rows<BITS, S, DERIVED>(R, a, r0, codes + p * panel_bytes, codes + (p + 1) * panel_bytes,
                                         sc.panel(p, groups), sc.panel(p + 1, groups), mn.panel(p, groups),
                                         mn.panel(p + 1, groups), min_factor, group_blocks,
                                         r0 == 0 ? prefetch_groups : 0, res, res_hi);
          store_tile<T>(res, R, r0, p, bias, N, out);
          store_tile<T>(res_hi, R, r0, p + 1, bias, N, out);
        }
#endif
      for (; p < pe; ++p) {
        const uint8_t* c = codes + p * panel_bytes;
        dispatch_rows<BITS, S, HALF, DERIVED>(R, a, r0, c, sc.panel(p, groups), mn.panel(p, groups), min_factor,
                                     group_blocks, prefetch_groups, res);
        store_tile<T>(res, R, r0, p, bias, N, out);
      }
    }
  }
}

// The inputs matmul_into rounds x over for a layer (0: a 32-block, quantize_row): a K-quant super-block of 256
// for GGUF Q4_K's and Q6_K's two-level layouts where the pairs kernel does not take them (llama.cpp's Q8_K).
inline int64_t x_span(int64_t bits, bool half, bool derived, const ScaleRef& scales) {
  if (scales.form != ScaleRef::kTwoLevel || paired(bits, half)) return 0;
  const int64_t groups = int64_t(1) << scales.shift;  // a super-block's
  const bool q4k = bits == 4 && !half && !derived && groups == kSpanGroups;
  const bool q6k = bits == 6 && half && groups == 2 * kQ6SpanBlocks;
  return q4k ? kBlock * kSpanGroups : q6k ? kBlock * kQ6SpanBlocks : 0;
}

// out [M, N] = x [M, K] (float32 or bf16, rows K apart) @ W^T (+ bias float32 [N] or nullptr), W in the
// layout above (group_size a multiple of 32, or 16 with 8-bit codes). Threads (torch's pool) split the
// panels; each task at least ~16 KB of codes x rows.
template <typename T>
void matmul_into(const T* x, int64_t M, int64_t K, const uint8_t* codes, const ScaleRef& scales,
                 const ScaleRef& mins, int64_t bits, int64_t group_size, const float* bias, int64_t N, T* out) {
  const int64_t nb = K / kBlock, panels = (N + kCols - 1) / kCols;
  const bool half = group_size == kHalfGroup;
  // the quantized activations: K + 8 K/32 bytes a row (+ 8 K/32 for group 16), reused by every panel
  static thread_local std::vector<int8_t> q_buf;
  static thread_local std::vector<float> d_buf;
  static thread_local std::vector<int32_t> s_buf, c_buf;
  q_buf.resize(M * K);
  d_buf.resize((half ? 4 : 2) * M * nb);
  int8_t* q = q_buf.data();
  float* d = d_buf.data();
  float* ds16 = half ? d + 2 * M * nb : nullptr;
  // derived mins (c x the scales) as int32 corrections: every kernel but panel_kernel_g16's (8-bit, group 16)
  const bool derived = mins.factor != 0.f;
  TORCH_CHECK(bits != 6 || mins.factor == -32.f, "woq_avx2: 6-bit (Q6_K) layers take mins of -32 x the scales");
  // x rounded per super-block where the pairs kernel does not take the layer: Q4_K (4-bit, two-level scales
  // and mins, 8 groups of 32 a super-block) for panel_kernel_span, Q6_K (6-bit, two-level scales, 16 groups
  // of 16) for panel_kernel_q6_span; they take the code sums per group (bsum) and none of the buffers below
  const int64_t span = x_span(bits, half, derived, scales);
  const bool corrected = derived && (!half || bits == 6) && !span;
  const bool sums = bits == 8 && !half && (derived || paired(bits, half));  // 128 x the code sums (a.qs128)
  const int64_t per = half ? 2 * nb : nb;
  if (sums) s_buf.resize(M * nb);
  if (corrected) c_buf.resize(M * per);
  int32_t* qs128 = sums ? s_buf.data() : nullptr;
  int32_t* corr = corrected ? c_buf.data() : nullptr;
  static thread_local std::vector<int16_t> b_buf;
  if (span) b_buf.resize(M * per);
  int16_t* bsum = span ? b_buf.data() : nullptr;  // a pointer: the lambda below runs on other threads too
  const QuantizedX a{q, d, d + M * nb, K, ds16, qs128, corr, bsum};
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (span)
        quantize_row_span(x + r * K, K, span, q + r * K, d + r * (K / span), bsum + r * per, half);
      else
        quantize_row(x + r * K, K, q + r * K, d + r * nb, d + M * nb + r * nb, half ? ds16 + 2 * r * nb : nullptr,
                     sums ? qs128 + r * nb : nullptr, corrected ? corr + r * per : nullptr, int32_t(mins.factor));
    }
  });
  const int64_t panel_work = nb * block_bytes(bits) * M;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / panel_work);
  // mins derived from the scales (mins.factor): the scales stand in for them, never read as mins
  with_scales(scales, mins.factor != 0.f ? scales : mins, [&](auto sc, auto mn) {
    using S = decltype(sc);
    // A fixed split of the panels (torch's parallel_for), each thread one contiguous run: tried, chunks of
    // ~1/8 a thread taken from an atomic counter (so a late thread would not stall each join) made one
    // decode step of the default model 17% slower at 1 sequence (2.85 against 2.43 ms) and 6% at 32
    // (scripts/ab_decode_stack.py, 100 and 40 rounds alternated): short runs of panels cut the hardware
    // prefetcher's streams, which a memory-bound step lives on.
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      auto run = [&](auto derived) {
        constexpr bool D = decltype(derived)::value;
        if (bits == 4)
          run_panels<4, S, T, false, D>(a, M, codes, sc, mn, mins.factor, group_size, bias, N, out, begin, end);
        else if (half)
          run_panels<8, S, T, true, D>(a, M, codes, sc, mn, mins.factor, group_size, bias, N, out, begin, end);
        else
          run_panels<8, S, T, false, D>(a, M, codes, sc, mn, mins.factor, group_size, bias, N, out, begin, end);
      };
      if (bits == 6)  // Q6_K's 6-bit codes, group 16 only: its mins always -32 x the scales (panel_kernel_q6)
        run_panels<6, S, T, true, true>(a, M, codes, sc, mn, mins.factor, group_size, bias, N, out, begin, end);
      else if (mins.factor != 0.f)
        run(std::true_type{});
      else
        run(std::false_type{});
    });
  });
}

// The same on tensors: x [M, K] float32 or bf16 (contiguous), codes / scales / mins in avx2.pack's layout,
// bias float32 [N] or undefined; returns [M, N] in x's dtype. What woq_avx2.cpp binds (after its checks)
// and what the fused decode stack (model/csrc/decode_stack.cpp) calls, so both run the same code.
inline at::Tensor matmul_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& mins, const at::Tensor& bias, int64_t bits, int64_t group_size,
                                int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const ScaleRef sc = scale_ref(scales), mn = mins_ref(mins, sc);
  if (x.scalar_type() == at::kFloat)
    matmul_into(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), sc, mn, bits,
                group_size, bp, N, out.data_ptr<float>());
  else
    matmul_into(x.data_ptr<at::BFloat16>(), M, K, codes.data_ptr<uint8_t>(), sc, mn, bits, group_size, bp, N, out.data_ptr<at::BFloat16>());
  return out;
}

// The float32-activation alternative for one row, kept for measurement (scripts/bench_woq_avx2.py times it
// at M=1): the codes become float32 in registers (shift, mask, convert) and FMA with x itself, the scale and
// min applied per group. Exact up to float32 summation order, but ~3x the instructions of the int8 path a
// weight (per 8 weights: shift, and, convert, FMA), so even a single row is bound by instructions rather
// than memory: one thread, CPU time, 576 -> 3072 Q4_1 hot 129 us vs int8 47 us; the 121 calls of the
// default model cold 11.4 ms vs 8.2 ms. So matmul quantizes x to int8 for every M, 1 included.
template <int BITS, typename S>
inline void panel_fp32(const float* x, const float* xsum, int64_t K, const uint8_t* codes, S sc, S mn,
                       float min_factor, int64_t group_blocks, float* res) {
  constexpr int64_t kBlockBytes = BITS == 4 ? 128 : 256;
  const int64_t groups = K / kBlock / group_blocks;
  const __m256i nibble = _mm256_set1_epi8(0x0F), byte = _mm256_set1_epi32(0xFF);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 d[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
      const uint8_t* c = codes + b * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes + line), _MM_HINT_T0);
      const float* xb = x + b * kBlock;
      for (int j = 0; j < 8; ++j) {  // quad j: k = 4j .. 4j + 3 of the block
        __m256i w;
        if constexpr (BITS == 4) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * (j & 3)));
          w = j < 4 ? _mm256_and_si256(raw, nibble) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        } else {
          w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j)),
                               _mm256_set1_epi8(char(0x80)));  // back to the unsigned code
        }
        for (int i = 0; i < 4; ++i) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, 8 * i), byte));
          d[i] = _mm256_fmadd_ps(q, _mm256_set1_ps(xb[4 * j + i]), d[i]);
        }
      }
    }
    const __m256 dot = _mm256_add_ps(_mm256_add_ps(d[0], d[1]), _mm256_add_ps(d[2], d[3]));
    acc = _mm256_fmadd_ps(dot, sc.at(g), acc);
    const __m256 m = min_factor == 0.f ? mn.at(g) : _mm256_mul_ps(sc.at(g), _mm256_set1_ps(min_factor));
    acc = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[g]), acc);
  }
  _mm256_storeu_ps(res, acc);
}

// One float32 row through panel_fp32, the panels split over threads (for the bench's comparison).
inline void gemv_fp32_into(const float* x, int64_t K, const uint8_t* codes, const ScaleRef& scales,
                           const ScaleRef& mins, int64_t bits, int64_t group_size, const float* bias, int64_t N,
                           float* out) {
  const int64_t groups = K / group_size, panels = (N + kCols - 1) / kCols;
  std::vector<float> xsum(groups, 0.f);
  for (int64_t k = 0; k < K; ++k) xsum[k / group_size] += x[k];
  const int64_t panel_bytes = K / kBlock * (bits == 4 ? 128 : 256);
  with_scales(scales, mins.factor != 0.f ? scales : mins, [&](auto sc, auto mn) {
    at::parallel_for(0, panels, std::max<int64_t>(1, 16384 / panel_bytes), [&](int64_t begin, int64_t end) {
      alignas(32) float res[1][kCols];
      for (int64_t p = begin; p < end; ++p) {
        const auto s = sc.panel(p, groups);
        const auto m = mn.panel(p, groups);
        if (bits == 4)
          panel_fp32<4>(x, xsum.data(), K, codes + p * panel_bytes, s, m, mins.factor, group_size / kBlock, res[0]);
        else
          panel_fp32<8>(x, xsum.data(), K, codes + p * panel_bytes, s, m, mins.factor, group_size / kBlock, res[0]);
        store_tile<float>(res, 1, 0, p, bias, N, out);
      }
    });
  });
}

}  // namespace woq_avx2
