// Weight-only quantized matmul on Intel AMX: y[M, N] = x[M, K] (bf16) @ W^T, with W stored as 4- or 8-bit
// codes and a float32 scale and min per group of the input (w = s * q + m, quantization/linear.py).
// `gemm_tensor` multiplies on the AMX tiles; woq_gemv.h has the 1-4 row kernel on the same layout.
// woq_amx.cpp binds both for Python (after asking the OS for the tile state); model/csrc/decode_stack.cpp
// calls them directly.
//
// Why: torch's packed INT4 / INT8 kernels dequantize the weight again for every row of x, so at a decode
// batch of 32 rows they cost 5x a bf16 GEMM, and bf16 weights make every decode step stream 2 bytes a
// weight from memory. Here each 32 x 16 piece of W is dequantized once per call into a 1 KB bf16 tile
// (in L1) and multiplied with every row of x by the AMX unit (TDPBF16PS, float32 accumulation), so a step
// streams 0.5 (4-bit) or 1 (8-bit) byte a weight and the dequantization is paid once, not once a row.
//
// Dequantization rounds like QuantLinear.dequantize_weight(bf16): float32 q * s, then + m, then one
// rounding to bf16 (this header turns floating-point contraction off for its code, whatever the build's
// flags, so the two steps are never fused into one FMA), and the
// products are summed in float32, as a bf16 GEMM does; only the order of that sum differs from oneDNN's.
//
// Layout (built by pack_codes below; N a multiple of 16, K of 32, the group size a multiple of 32):
//   codes   uint8 [N/16, K/2, 16] (4-bit) or [N/16, K/2, 32] (8-bit): for output columns n0..n0+15 and the
//           input pair (2p, 2p+1), the 32 codes in TDPBF16PS's B-tile order e = 2n + (k % 2); 4-bit codes
//           hold e in the low nibble of byte e and e + 16 in the high nibble of byte e (e < 16).
//   scales, mins  float32 [N/16, groups, 16], or float16 where that holds them exactly, or two-level (GGUF's
//           K-quants), or mins derived from the scales (GGUF's symmetric types): FlatGroups and its kin below
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace woq {


constexpr int kTile = 16;        // rows of every tile; A / B tiles are 64 bytes (32 bf16) wide
constexpr int kKStep = 32;       // input elements one TDPBF16PS consumes

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..3: C (m-subtile x n-subtile), tmm4/5: A (two m-subtiles), tmm6/7: B (two n-subtiles); all 16 x 64 B
inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  _tile_loadconfig(&cfg);
}

// 16 scales or mins as float32: stored so, or as float16 where that held them exactly (GGUF's blocks)
inline __m512 load16(const float* v) { return _mm512_loadu_ps(v); }
inline __m512 load16(const at::Half* v) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
}

// 16 float32 results rounded to bf16, to nearest even (as ATen rounds; denormals, which VCVTNEPS2BF16
// flushes, aside)
inline void store_bf16(at::BFloat16* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// The layout's scales and mins, in the smallest form that holds them exactly (amx.pack_codes chooses):
//   FlatGroups<S>     S (float32, or float16 where that holds them: GGUF's Q4_0, Q8_0) [N/16, groups, 16]
//   TwoLevelGroups    GGUF's K-quants (Q4_K): uint8 [N/16, groups / sb, 32 + 16 sb], per super-block the 16
//                     columns' float16 d, then sb groups x 16 int8 codes; a group's value is d x code (exact
//                     in float32: 11 + 8 bits), 0.625 bits a weight to stream where float32 took 2
//   DerivedMins       mins = c x scales, c a power of two (GGUF's symmetric types: Q4_0 -8, Q8_0 -128): only
//                     c is kept (a one-element float32 tensor), half the bytes a float16 layout streams
// at(ns, g): 16 columns' values of n-subtile ns, group g, as float32 (a derived min from that group's scale);
// line(ns, g): an address in that group's bytes, to prefetch; kSignificantBits: at most how many a value has.
template <typename S>
struct FlatGroups {
  const S* p;
  int64_t groups;
  static constexpr int kSignificantBits = std::is_same_v<S, at::Half> ? 11 : 24;
  const S* line(int64_t ns, int64_t g) const { return p + (ns * groups + g) * kTile; }
  __m512 at(int64_t ns, int64_t g) const { return load16(line(ns, g)); }
  __m512 at(int64_t ns, int64_t g, __m512) const { return at(ns, g); }
};

struct TwoLevelGroups {
  const uint8_t* p;
  int64_t supers, shift, row_bytes;  // super-blocks a subtile; log2 of groups a super-block; 32 + 16 sb
  static constexpr int kSignificantBits = 11 + 7;  // float16 d x an int8 code
  const uint8_t* line(int64_t ns, int64_t g) const { return p + (ns * supers + (g >> shift)) * row_bytes; }
  __m512 at(int64_t ns, int64_t g) const {
    const uint8_t* s = line(ns, g);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const int64_t j = g & ((int64_t(1) << shift) - 1);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32 + j * kTile));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
  __m512 at(int64_t ns, int64_t g, __m512) const { return at(ns, g); }
};

struct DerivedMins {
  float c;
  const void* line(int64_t, int64_t) const { return nullptr; }
  __m512 at(int64_t, int64_t, __m512 scale) const { return _mm512_mul_ps(_mm512_set1_ps(c), scale); }
};

inline void prefetch_line(const void* p) {
  if (p != nullptr) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// Calls fn(scales, mins) with the forms these tensors hold (woq_amx.cpp's check_args checks their shapes).
template <typename Fn>
inline void with_groups(const at::Tensor& scales, const at::Tensor& mins, int64_t groups, Fn&& fn) {
  if (scales.scalar_type() == at::kByte) {
    const int64_t row_bytes = scales.size(2), sb = (row_bytes - 32) / kTile;
    const TwoLevelGroups sc{scales.data_ptr<uint8_t>(), groups / sb, __builtin_ctzll(sb), row_bytes};
    TORCH_CHECK(mins.scalar_type() == at::kByte, "woq_amx: two-level scales need two-level mins");
    return fn(sc, TwoLevelGroups{mins.data_ptr<uint8_t>(), groups / sb, __builtin_ctzll(sb), row_bytes});
  }
  if (scales.scalar_type() == at::kHalf) {
    const FlatGroups<at::Half> sc{scales.data_ptr<at::Half>(), groups};
    if (mins.numel() == 1) return fn(sc, DerivedMins{mins.data_ptr<float>()[0]});
    return fn(sc, FlatGroups<at::Half>{mins.data_ptr<at::Half>(), groups});
  }
  return fn(FlatGroups<float>{scales.data_ptr<float>(), groups}, FlatGroups<float>{mins.data_ptr<float>(), groups});
}

// [s0..s15] -> ([s0,s0,s1,s1,..,s7,s7], [s8,s8,..,s15,s15]): one value per e = 2n + k%2
inline void pair_up(__m512 x, __m512& lo, __m512& hi) {
  const __m512i idx_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i idx_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  lo = _mm512_permutexvar_ps(idx_lo, x);
  hi = _mm512_permutexvar_ps(idx_hi, x);
}

// One B tile: 16 pair rows x 16 columns of bf16 pairs, from the codes of one K-step of one n-subtile.
// With float16 scales (GGUF's blocks) q * s is exact in float32 (at most 8 + 11 significant bits), and so
// with two-level ones and 4-bit codes (4 + 11 + 6), so one FMA rounds q * s + m exactly as the multiply and
// the add do: 9 instructions per 32 4-bit weights instead of 13 with the 4-bit codes widened once and split
// into nibbles as 32-bit lanes.
template <int BITS, bool EXACT_PRODUCT>
inline void dequantize_tile(const uint8_t* codes, __m512 scale, __m512 min, __m512bh* tile) {
  __m512 s_lo, s_hi, m_lo, m_hi;
  pair_up(scale, s_lo, s_hi);
  pair_up(min, m_lo, m_hi);
  for (int p = 0; p < kTile; ++p) {
    __m512 f0, f1;  // the codes of e 0..15 and 16..31 as float32
    if constexpr (BITS == 4) {
      // a 4-bit code indexes a table of 0.0 .. 15.0: VPERMPS reads only an index's low 4 bits, so the
      // low nibble needs no mask, and the permutes run on port 5 where the int-to-float conversions
      // queued with the FMAs and the bf16 rounding on port 0 (the same floats: ~5% a call)
      const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 16)));
      f0 = _mm512_permutexvar_ps(v, table);
      f1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else {
      f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 32))));
      f1 = _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 32 + 16))));
    }
    __m512 w0, w1;
    if constexpr (EXACT_PRODUCT) {
      w0 = _mm512_fmadd_ps(f0, s_lo, m_lo);
      w1 = _mm512_fmadd_ps(f1, s_hi, m_hi);
    } else {  // float32 scales: q * s rounds, then + m rounds again
      w0 = _mm512_add_ps(_mm512_mul_ps(f0, s_lo), m_lo);
      w1 = _mm512_add_ps(_mm512_mul_ps(f1, s_hi), m_hi);
    }
    tile[p] = _mm512_cvtne2ps_pbh(w1, w0);  // e 0..15 from w0, 16..31 from w1, round to nearest even
  }
}

// How far ahead the dequantization asks for codes (and scales / mins, in groups of 32): at a decode or
// prefill step the weights come from L3 / DRAM. All 121 calls of a GGUF-native step, alternated in one
// session: 50 rows 34.4 / 31.2 ms without, 26.3 / 24.4 ms at 1 KB ahead; 32 rows 24.7 / 21.9 against
// 19.0 / 17.6 ms (512 B about the same, 2-4 KB no better).
constexpr int64_t kAmxPrefetchBytes = 1024, kAmxPrefetchGroups = 4;

// At up to 32 rows of x, each k-step's B tiles are made kAhead k-steps before their products, into a ring
// of kRing k-steps (woq_gemm)
constexpr int64_t kRing = 4, kAhead = 2;

// How many bytes of dequantized weights (blocks of 32 output columns) are made at once when x has more
// than 64 rows: they stay in L2 while every 32 rows of x pass over them (7 blocks at K = 576, 2 at 1536).
// From kLongStripRows rows of x on, strips twice as long: x is read again for every strip, and at a large
// prefill that costs more than the longer wait before a strip's first products. The model's 120 4-bit
// layers, 256 against 512 KB alternated: 2,048 rows 264.2 -> 236.8 ms, 956 rows 121.1 -> 115.1 ms; at 100
// rows 19.7 -> 21.6 ms (worse), at 400-768 rows within noise either way.
constexpr int64_t kStripBytes = 256 * 1024, kLongStripRows = 896;

// This thread's buffer for n dequantized tile rows, kept from call to call: allocated per call, glibc
// handed it back to the OS when it was freed and the next call faulted it in again (new pages zeroed by
// the kernel). A captured W32 decode step's layers, stacks alternated in shuffled order: 33.9 -> 32.8
// ms. new[] of a 64-byte vector type is 64-byte aligned and left uninitialized.
inline __m512bh* strip_buffer(size_t n) {
  thread_local std::unique_ptr<__m512bh[]> buffer;
  thread_local size_t capacity = 0;
  if (n > capacity) {
    buffer.reset(new __m512bh[n]);
    capacity = n;
  }
  return buffer.get();
}

// x [M, K] contiguous; tail: x's last M % 16 rows zero-padded to 16 (a tile reads 16 rows), undefined
// when M is a multiple of 16.
template <int BITS, typename Sc, typename Mn>
void woq_gemm(const at::Tensor& x, const at::Tensor& tail, const at::Tensor& codes, const Sc& sc, const Mn& mn,
              const at::Tensor& bias, int64_t group_size, at::Tensor& out) {
  constexpr bool kExactProduct = Sc::kSignificantBits + BITS <= 24;  // q * s exact in float32: one FMA
  const int64_t M = out.size(0), N = out.size(1), K = x.size(1);
  const int64_t Mp = (M + kTile - 1) / kTile * kTile;
  const int64_t ksteps = K / kKStep, groups = K / group_size, nsub_total = N / kTile;
  const int64_t code_row_bytes = BITS == 4 ? 16 : 32;  // per pair row of one n-subtile
  const auto* xp = reinterpret_cast<const uint8_t*>(x.data_ptr<at::BFloat16>());
  const auto* tp = tail.defined() ? reinterpret_cast<const uint8_t*>(tail.data_ptr<at::BFloat16>()) : nullptr;
  auto rows_at = [&](int64_t r0) { return r0 + kTile <= M ? xp + r0 * K * 2 : tp; };  // 16 rows from r0
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t nblocks = (nsub_total + 1) / 2;  // blocks of 32 output columns (the last may have 16)
  // a task of at least ~64 KB of weight codes before a second thread is woken
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(K * 32 * BITS / 8, 1));
  // With more than two passes over x's rows (a prefill), blocks are dequantized strip_bytes at a time
  // and each 32 rows of x, loaded once into L1, meet all of them: one block at a time streamed all of x
  // from L3 again for every 32 columns (2 MB of x per block at 2,000 rows).
  const int64_t strip_bytes = (Mp >= kLongStripRows ? 2 : 1) * kStripBytes;
  const int64_t strip_blocks = Mp > 4 * kTile ? std::clamp<int64_t>(strip_bytes / (K * 2 * kTile * 2), 1, nblocks) : 1;
  const int64_t tiles_per_block = ksteps * 2 * kTile;  // 16-row bf16 tile rows of one block's K x 32 weights
  const int64_t block_code_bytes = 2 * (K / 2) * code_row_bytes;  // codes of one block (two n-subtiles)
  // n-subtile ns (of block ns / 2) at k-step ks dequantized into that block's tiles
  auto dequantize_subtile_to = [&](__m512bh* dst, int64_t ns, int64_t ks) {
    const int64_t g = group_size == kKStep ? ks : ks * kKStep / group_size;  // (no division for GGUF's blocks)
    const uint8_t* c = cp + ns * (K / 2) * code_row_bytes + ks * kTile * code_row_bytes;
    // codes, scales and mins come from L3 / DRAM: ask for them ahead (as the gemv kernel does)
    for (int64_t line = 0; line < kTile * code_row_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c + kAmxPrefetchBytes + line), _MM_HINT_T0);
    prefetch_line(sc.line(ns, g + kAmxPrefetchGroups));  // past the last group: the next subtile's first
    prefetch_line(mn.line(ns, g + kAmxPrefetchGroups));
    const __m512 s = sc.at(ns, g);
    dequantize_tile<BITS, kExactProduct>(c, s, mn.at(ns, g, s), dst);
  };
  // ... into its place among a block's tiles (k-step by k-step, two n-subtiles each)
  auto dequantize_subtile = [&](__m512bh* tiles, int64_t ns, int64_t ks) {
    dequantize_subtile_to(tiles + (ks * 2 + ns % 2) * kTile, ns, ks);
  };
  auto subtiles_end = [&](int64_t nb) { return std::min(nb * 2 + 2, nsub_total); };
  at::parallel_for(0, nblocks, grain, [&](int64_t nb_begin, int64_t nb_end) {
    load_tile_config();
    // dequantized weights: strip_blocks blocks (a prefill), two blocks taking turns, or a ring of k-steps
    __m512bh* const strip =
        strip_buffer(size_t(std::max(std::max<int64_t>(strip_blocks, 2) * tiles_per_block, kRing * 2 * kTile)));
    // C tiles land in one of two buffers and are rounded into out one block later: a block's conversion
    // then runs while the AMX unit works on the next block, instead of waiting on its own tile stores
    alignas(64) float cbuf[2][4][kTile * kTile];
    struct Pending {
      int64_t m0 = -1, ns0 = 0;
      int msubs = 0, nsubs = 0;
    } pending[2];
    int cur = 0;
    auto flush = [&](int b) {
      const Pending& p = pending[b];
      if (p.m0 < 0) return;
      for (int ms = 0; ms < p.msubs; ++ms)
        for (int r = 0; r < kTile; ++r) {
          const int64_t row = p.m0 + ms * kTile + r;
          if (row >= M) break;
          for (int s = 0; s < p.nsubs; ++s) {
            const int64_t n0 = (p.ns0 + s) * kTile;
            __m512 v = _mm512_load_ps(cbuf[b][ms * 2 + s] + r * kTile);
            if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + n0));
            store_bf16(op + row * N + n0, v);
          }
        }
      pending[b].m0 = -1;
    };
    // rows m0.. (16 or 32) of x times block nb, whose dequantized tiles at k-step ks start at tiles_at(ks)
    // (two n-subtiles' B tiles, one after the other); between(ks) runs after each k-step's tile products are
    // issued, while the AMX unit works on them
    auto block_products_at = [&](auto&& tiles_at, int64_t m0, int64_t nb, auto&& between) {
      const int msubs = m0 + kTile < Mp ? 2 : 1;
      const int nsubs = nb * 2 + 1 < nsub_total ? 2 : 1;
      const uint8_t* a0 = rows_at(m0);
      const uint8_t* a1 = msubs == 2 ? rows_at(m0 + kTile) : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t ks = 0; ks < ksteps; ++ks) {
        const __m512bh* b = tiles_at(ks);
        _tile_loadd(6, b, 64);
        _tile_loadd(4, a0 + ks * 64, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (nsubs == 2) {
          _tile_loadd(7, b + kTile, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (msubs == 2) {
          _tile_loadd(5, a1 + ks * 64, K * 2);
          _tile_dpbf16ps(2, 5, 6);
          if (nsubs == 2) _tile_dpbf16ps(3, 5, 7);
        }
        between(ks);
      }
      flush(cur ^ 1);  // the previous block's results, while this block's products finish
      _tile_stored(0, cbuf[cur][0], 64);
      _tile_stored(1, cbuf[cur][1], 64);
      _tile_stored(2, cbuf[cur][2], 64);
      _tile_stored(3, cbuf[cur][3], 64);
      pending[cur] = Pending{m0, nb * 2, msubs, nsubs};
      cur ^= 1;
    };
    auto block_products = [&](const __m512bh* tiles, int64_t m0, int64_t nb, auto&& between) {
      block_products_at([&](int64_t ks) { return tiles + ks * 2 * kTile; }, m0, nb, between);
    };
    // asks, a k-step's share at a time, for the codes of block na (if this thread has it) while block
    // products run: what the products of that block will read from L3 / DRAM
    auto prefetch_block = [&](int64_t na) {
      const uint8_t* ahead = cp + na * block_code_bytes;
      const int64_t lines = na < nb_end ? (subtiles_end(na) - na * 2) * (K / 2) * code_row_bytes / 64 : 0;
      const int64_t per_step = (lines + ksteps - 1) / ksteps;
      return [=](int64_t ks) {
        for (int64_t i = ks * per_step; i < std::min(lines, (ks + 1) * per_step); ++i)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + i * 64), _MM_HINT_T0);
      };
    };
    if (strip_blocks > 1) {
      for (int64_t sb = nb_begin; sb < nb_end; sb += strip_blocks) {
        const int64_t sb_end = std::min(sb + strip_blocks, nb_end);
        for (int64_t nb = sb; nb < sb_end; ++nb)
          for (int64_t ns = nb * 2; ns < subtiles_end(nb); ++ns)
            for (int64_t ks = 0; ks < ksteps; ++ks)
              dequantize_subtile(strip + (nb - sb) * tiles_per_block, ns, ks);
        for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kTile)
          for (int64_t nb = sb; nb < sb_end; ++nb)
            block_products(strip + (nb - sb) * tiles_per_block, m0, nb, [](int64_t) {});
      }
    } else if (Mp <= 2 * kTile) {
      // Up to 32 rows of x (a decode step): one pass over them, so each k-step's B tiles are used once,
      // right after they are made. They are made kAhead k-steps ahead, between the tile products, into a
      // ring of kRing k-steps (8 KB) that stays in L1, instead of a whole block ahead into two block-sized
      // buffers (2 x 36 KB at K = 576) that spilled to L2: each tile row then cost a write-allocate and a
      // read back from L2. The same tiles, so the same products. Codes of block nb + 3 asked for as below
      // (nb + 2, 4 or 6: the same). Old and new alternated: the 120 4-bit layers at 32 rows 9.21 -> 8.37 ms
      // (8 rows 8.18 -> 7.38), the 8-bit lm_head 2.54 -> 2.38 ms; a captured W32 step's layers 20.65 -> 19.89.
      const int64_t items = (nb_end - nb_begin) * ksteps;  // (block, k-step) in the order they are multiplied
      auto ring_slot = [&](int64_t i) { return strip + (i % kRing) * 2 * kTile; };
      auto dequantize_item = [&](int64_t i) {
        const int64_t nb = nb_begin + i / ksteps, ks = i % ksteps;
        for (int64_t ns = nb * 2; ns < subtiles_end(nb); ++ns)
          dequantize_subtile_to(ring_slot(i) + (ns % 2) * kTile, ns, ks);
      };
      for (int64_t i = 0; i < std::min(kAhead, items); ++i) dequantize_item(i);
      for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
        const int64_t first = (nb - nb_begin) * ksteps;
        auto prefetch = prefetch_block(nb + 3);
        block_products_at([&](int64_t ks) { return ring_slot(first + ks); }, 0, nb, [&](int64_t ks) {
          prefetch(ks);
          if (first + ks + kAhead < items) dequantize_item(first + ks + kAhead);
        });
      }
    } else {
      // One block at a time (33-64 rows of x: two passes over a block), in two buffers taking turns: while the
      // AMX unit multiplies block nb, the core dequantizes block nb + 1, a k-step between each k-step's tile
      // products, and asks for block nb + 3's codes (nb + 2: a third less gain in a decode step, where the
      // attention between the products leaves the weights to come from memory). Dequantizing a block and
      // then multiplying it left the AMX unit idle during the one and the core during the other. The same
      // tiles, so the same products. Measured when this path still took 32 rows too (the ring above has them
      // since): 120 4-bit layers 13.9 -> 11.5 ms, the 8-bit lm_head 3.6 -> 3.1; a W32 step's layers 33.7 -> 32.4.
      for (int64_t ns = nb_begin * 2; ns < subtiles_end(nb_begin); ++ns)
        for (int64_t ks = 0; ks < ksteps; ++ks) dequantize_subtile(strip, ns, ks);
      for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
        __m512bh* tiles = strip + ((nb - nb_begin) & 1) * tiles_per_block;
        __m512bh* next = strip + ((nb - nb_begin + 1) & 1) * tiles_per_block;
        auto prefetch = prefetch_block(nb + 3);
        for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kTile)
          block_products(tiles, m0, nb, [&](int64_t ks) {
            if (m0 > 0 || nb + 1 == nb_end) return;
            prefetch(ks);
            for (int64_t ns = (nb + 1) * 2; ns < subtiles_end(nb + 1); ++ns) dequantize_subtile(next, ns, ks);
          });
      }
    }
    flush(cur ^ 1);
    _tile_release();
  });
}

// x [M, K] bf16 times the layer in the AMX layout; bias float32 [N] or undefined. Returns bf16 [M, N].
// The buffers' shapes are the caller's to check (woq_amx.cpp's check_args).
inline at::Tensor gemm_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const at::Tensor& bias, int64_t bits, int64_t group_size,
                              int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const at::Tensor xa = x.contiguous();
  at::Tensor tail;  // the tiles read 16 rows: the last partial tile's rows, padded with zeros
  if (const int64_t rest = M % kTile) {
    tail = at::zeros({kTile, K}, x.options());
    std::copy_n(xa.data_ptr<at::BFloat16>() + (M - rest) * K, rest * K, tail.data_ptr<at::BFloat16>());
  }
  with_groups(scales, mins, K / group_size, [&](const auto& sc, const auto& mn) {
    using Sc = std::decay_t<decltype(sc)>;
    using Mn = std::decay_t<decltype(mn)>;
    if (bits == 4)
      woq_gemm<4, Sc, Mn>(xa, tail, codes, sc, mn, bias, group_size, out);
    else
      woq_gemm<8, Sc, Mn>(xa, tail, codes, sc, mn, bias, group_size, out);
  });
  return out;
}

}  // namespace woq

#pragma GCC pop_options
