// Weight-only quantized matmul on Intel AMX: y[M, N] = x[M, K] (bf16) @ W^T, with W stored as 4- or 8-bit
// codes and a float32 scale and min per group of the input (w = s * q + m, quantization/linear.py).
// `gemm` multiplies on the AMX tiles; `gemv` (1-4 rows, further down) uses AVX512-BF16 dot products on the
// same layout.
//
// Why: torch's packed INT4 / INT8 kernels dequantize the weight again for every row of x, so at a decode
// batch of 32 rows they cost 5x a bf16 GEMM, and bf16 weights make every decode step stream 2 bytes a
// weight from memory. Here each 32 x 16 piece of W is dequantized once per call into a 1 KB bf16 tile
// (in L1) and multiplied with every row of x by the AMX unit (TDPBF16PS, float32 accumulation), so a step
// streams 0.5 (4-bit) or 1 (8-bit) byte a weight and the dequantization is paid once, not once a row.
//
// Dequantization rounds like QuantLinear.dequantize_weight(bf16): float32 q * s, then + m, then one
// rounding to bf16 (this file is built with -ffp-contract=off, so the two steps are never fused), and the
// products are summed in float32, as a bf16 GEMM does; only the order of that sum differs from oneDNN's.
//
// Layout (built by pack_codes below; N a multiple of 16, K of 32, the group size a multiple of 32):
//   codes   uint8 [N/16, K/2, 16] (4-bit) or [N/16, K/2, 32] (8-bit): for output columns n0..n0+15 and the
//           input pair (2p, 2p+1), the 32 codes in TDPBF16PS's B-tile order e = 2n + (k % 2); 4-bit codes
//           hold e in the low nibble of byte e and e + 16 in the high nibble of byte e (e < 16).
//   scales, mins  float32 [N/16, groups, 16]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include "woq_gemv.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <memory>

namespace {

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
void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  _tile_loadconfig(&cfg);
}

// Linux hands out the AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("avx512bf16"))
    return false;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// [s0..s15] -> ([s0,s0,s1,s1,..,s7,s7], [s8,s8,..,s15,s15]): one value per e = 2n + k%2
inline void pair_up(const float* v, __m512& lo, __m512& hi) {
  const __m512 x = _mm512_loadu_ps(v);
  const __m512i idx_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i idx_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  lo = _mm512_permutexvar_ps(idx_lo, x);
  hi = _mm512_permutexvar_ps(idx_hi, x);
}

// One B tile: 16 pair rows x 16 columns of bf16 pairs, from the codes of one K-step of one n-subtile.
template <int BITS>
inline void dequantize_tile(const uint8_t* codes, const float* scale, const float* min, __m512bh* tile) {
  __m512 s_lo, s_hi, m_lo, m_hi;
  pair_up(scale, s_lo, s_hi);
  pair_up(min, m_lo, m_hi);
  for (int p = 0; p < kTile; ++p) {
    __m128i lo8, hi8;
    if constexpr (BITS == 4) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 16));
      const __m128i mask = _mm_set1_epi8(0x0F);
      lo8 = _mm_and_si128(v, mask);
      hi8 = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    } else {
      lo8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 32));
      hi8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 32 + 16));
    }
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo8));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi8));
    const __m512 w0 = _mm512_add_ps(_mm512_mul_ps(q0, s_lo), m_lo);
    const __m512 w1 = _mm512_add_ps(_mm512_mul_ps(q1, s_hi), m_hi);
    tile[p] = _mm512_cvtne2ps_pbh(w1, w0);  // e 0..15 from w0, 16..31 from w1, round to nearest even
  }
}

template <int BITS>
void woq_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
              const at::Tensor& bias, int64_t group_size, at::Tensor& out) {
  const int64_t M = out.size(0), N = out.size(1), K = x.size(1);
  const int64_t Mp = x.size(0);  // padded to a multiple of 16 rows
  const int64_t ksteps = K / kKStep, groups = K / group_size, nsub_total = N / kTile;
  const int64_t code_row_bytes = BITS == 4 ? 16 : 32;  // per pair row of one n-subtile
  const auto* xp = reinterpret_cast<const uint8_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t nblocks = (nsub_total + 1) / 2;  // blocks of 32 output columns (the last may have 16)
  // a task of at least ~64 KB of weight codes before a second thread is woken
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(K * 32 * BITS / 8, 1));
  at::parallel_for(0, nblocks, grain, [&](int64_t nb_begin, int64_t nb_end) {
    load_tile_config();
    // K x 32 dequantized weights; new[] of a 64-byte vector type is 64-byte aligned and left uninitialized
    std::unique_ptr<__m512bh[]> strip(new __m512bh[size_t(ksteps) * 2 * kTile]);
    __m512bh* tiles = strip.get();
    alignas(64) float cbuf[4][kTile * kTile];
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const int64_t ns0 = nb * 2;
      const int nsubs = ns0 + 1 < nsub_total ? 2 : 1;
      for (int s = 0; s < nsubs; ++s) {
        const int64_t ns = ns0 + s;
        const uint8_t* c = cp + ns * (K / 2) * code_row_bytes;
        for (int64_t ks = 0; ks < ksteps; ++ks) {
          const int64_t g = ks * kKStep / group_size;
          dequantize_tile<BITS>(c + ks * kTile * code_row_bytes, sp + (ns * groups + g) * kTile,
                                mp + (ns * groups + g) * kTile, tiles + (ks * 2 + s) * kTile);
        }
      }
      for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kTile) {
        const int msubs = m0 + kTile < Mp ? 2 : 1;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint8_t* a = xp + m0 * K * 2;
        for (int64_t ks = 0; ks < ksteps; ++ks) {
          const __m512bh* b = tiles + ks * 2 * kTile;
          _tile_loadd(6, b, 64);
          _tile_loadd(4, a + ks * 64, K * 2);
          _tile_dpbf16ps(0, 4, 6);
          if (nsubs == 2) {
            _tile_loadd(7, b + kTile, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (msubs == 2) {
            _tile_loadd(5, a + kTile * K * 2 + ks * 64, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (nsubs == 2) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        _tile_stored(2, cbuf[2], 64);
        _tile_stored(3, cbuf[3], 64);
        for (int ms = 0; ms < msubs; ++ms) {
          for (int r = 0; r < kTile; ++r) {
            const int64_t row = m0 + ms * kTile + r;
            if (row >= M) break;
            for (int s = 0; s < nsubs; ++s) {
              const float* cr = cbuf[ms * 2 + s] + r * kTile;
              const int64_t n0 = (ns0 + s) * kTile;
              at::BFloat16* o = op + row * N + n0;  // rounded to nearest even, as ATen rounds
              for (int j = 0; j < kTile; ++j) o[j] = at::BFloat16(bp ? cr[j] + bp[n0 + j] : cr[j]);
            }
          }
        }
      }
    }
    _tile_release();
  });
}


}  // namespace

bool available() {
  static const bool ok = request_amx();
  return ok;
}

// The checks both entry points make: x [M, K] bf16, a shape the tiles cover, and buffers that match it.
static void check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       int64_t bits, int64_t group_size, int64_t N) {
  TORCH_CHECK(available(), "woq_amx: AMX is not available on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "woq_amx: x must be [M, K] bf16");
  TORCH_CHECK(bits == 4 || bits == 8, "woq_amx: bits must be 4 or 8");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kKStep == 0 && group_size % kKStep == 0 && K % group_size == 0 && N % kTile == 0,
              "woq_amx: needs K and the group size multiples of 32, N of 16");
  TORCH_CHECK(codes.numel() == N * K * bits / 8 && scales.numel() == N * (K / group_size) &&
                  mins.numel() == scales.numel(),
              "woq_amx: codes / scales / mins do not match the shape");
}

// x [M, K] bf16; bias float32 [N] or None. Returns bf16 [M, N].
at::Tensor gemm(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins, c10::optional<at::Tensor> bias,
                int64_t bits, int64_t group_size, int64_t out_features) {
  check_args(x, codes, scales, mins, bits, group_size, out_features);
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  const int64_t Mp = (M + kTile - 1) / kTile * kTile;
  at::Tensor xa = x.contiguous();
  if (Mp != M) {  // the tiles read 16 rows: pad with zeros (the padded rows are computed and dropped)
    xa = at::zeros({Mp, K}, x.options());
    xa.narrow(0, 0, M).copy_(x);
  }
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  if (bits == 4)
    woq_gemm<4>(xa, codes, scales, mins, b, group_size, out);
  else
    woq_gemm<8>(xa, codes, scales, mins, b, group_size, out);
  return out;
}

// The same product for 1-4 rows of x with AVX512-BF16 dot products (no AMX tiles): woq_gemv.h.
at::Tensor gemv(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins, c10::optional<at::Tensor> bias,
                int64_t bits, int64_t group_size, int64_t out_features) {
  check_args(x, codes, scales, mins, bits, group_size, out_features);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  return woq::gemv_tensor(x, codes, scales, mins, b, bits, group_size, out_features);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU and kernel let the process use AMX (asks once)");
  m.def("gemm", &gemm, "x @ dequantize(codes, scales, mins)^T on AMX");
  m.def("gemv", &gemv, "the same for 1-4 rows, AVX512-BF16 dot products on the codes");
}
