// Decode paged attention on the CPU: one query token per sequence, K/V read in place through the
// block table (no gathered copy of the context). Parallel over (sequence, KV head); the query heads
// of a GQA group share every K/V load. Accumulates in float whatever the cache dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for pybind11, without all of torch/extension.h

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// exp for the softmax, written so the compiler vectorizes it (glibc's expf is scalar; 6% of the kernel's
// time went): exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 split in two constants
// (Cody-Waite), exp(r) by Cephes' degree-6 polynomial; about 1 ulp in float, inputs are <= 0 here.
static inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float's exponent field
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// softmax of each of `rows` rows of `len` scores, in place
static void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = fast_exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

// HEAD_DIM > 0 fixes head_dim at compile time (fully unrolled, vectorized inner loops); 0 = any.
template <typename scalar_t, int64_t HEAD_DIM>
static void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int64_t* tables, const int64_t* lens, scalar_t* out, int64_t B,
                          int64_t H, int64_t KVH, int64_t head_dim, int64_t BS, int64_t max_blocks,
                          float scale) {
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t L = lens[b];
      scores.assign(G * L, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = float(q[(b * H + h * G + g) * D + d]) * scale;
      // scores = q . k for every position, through the block table
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = tables[b * max_blocks + t / BS] * BS + t % BS;
        const scalar_t* k = k_cache + (slot * KVH + h) * D;
        float kf[256];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kf[d] = float(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = qf.data() + g * D;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * L + t] = s;
        }
      }
      softmax_rows(scores.data(), G, L);
      // out = p . v
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = tables[b * max_blocks + t / BS] * BS + t % BS;
        const scalar_t* v = v_cache + (slot * KVH + h) * D;
        float vf[256];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vf[d] = float(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) out[(b * H + h * G + g) * D + d] = scalar_t(acc[g * D + d]);
    }
  });
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
// The bf16 cache on CPUs with AVX512-BF16, head_dim a multiple of 32: q.k by vdpbf16ps straight from the
// bf16 cache (pairs of products summed in float, no conversion pass), p.v in float FMAs. The kernel is
// bound by memory latency, not arithmetic: the blocks of a sequence are scattered, so the next block's
// K and V rows are prefetched while this block is computed. Measured (1 thread, 32 sequences of
// 150-350 tokens, 9 heads over 3 KV heads, head_dim 64): 1.2 ms a layer for the portable kernel,
// 0.73 ms for this one.
static void decode_bf16_avx512(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                               const int64_t* tables, const int64_t* lens, at::BFloat16* out, int64_t B, int64_t H,
                               int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH, C = D / 32, V = D / 16;  // C bf16 chunks of 32, V float vectors of 16
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> qv(G * C);
    std::vector<__m512> acc(G * V);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t L = lens[b];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c)
          qv[g * C + c] = (__m512bh)_mm512_loadu_si512(q + (b * H + h * G + g) * D + c * 32);
      const int64_t* table = tables + b * max_blocks;
      // walk the block table block by block: no division per token
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const at::BFloat16* kb = k_cache + (table[t0 / BS] * BS * KVH + h) * D;
        // the next block's rows: blocks are scattered, so the hardware prefetcher cannot guess them
        const at::BFloat16* kn = t0 + BS < L ? k_cache + (table[t0 / BS + 1] * BS * KVH + h) * D : kb;
        for (int64_t t = t0; t < std::min(L, t0 + BS); ++t) {
          const at::BFloat16* k = kb + (t - t0) * KVH * D;
          const at::BFloat16* pf = kn + (t - t0) * KVH * D;
          for (int64_t c = 0; c < D; c += 32) {
            _mm_prefetch((const char*)(pf + c), _MM_HINT_T0);
            // this token's V row, for the p.v pass below: to L2 while the scores are computed
            _mm_prefetch((const char*)(pf + c + (v_cache - k_cache)), _MM_HINT_T1);
          }
          for (int64_t g = 0; g < G; ++g) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < C; ++c)
              dot = _mm512_dpbf16_ps(dot, qv[g * C + c], (__m512bh)_mm512_loadu_si512(k + c * 32));
            scores[g * L + t] = _mm512_reduce_add_ps(dot) * scale;
          }
        }
      }
      softmax_rows(scores.data(), G, L);
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const at::BFloat16* vb = v_cache + (table[t0 / BS] * BS * KVH + h) * D;
        const at::BFloat16* vn = t0 + BS < L ? v_cache + (table[t0 / BS + 1] * BS * KVH + h) * D : vb;
        for (int64_t t = t0; t < std::min(L, t0 + BS); ++t) {
          const at::BFloat16* v = vb + (t - t0) * KVH * D;
          const at::BFloat16* pf = vn + (t - t0) * KVH * D;
          for (int64_t c = 0; c < D; c += 32) _mm_prefetch((const char*)(pf + c), _MM_HINT_T0);
          for (int64_t i = 0; i < V; ++i) {
            // bf16 -> float: the 16 bits become the high half of each 32-bit lane
            const __m512 vf = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + i * 16))), 16));
            for (int64_t g = 0; g < G; ++g)
              acc[g * V + i] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * L + t]), vf, acc[g * V + i]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        at::BFloat16* o = out + (b * H + h * G + g) * D;
        alignas(64) float tmp[16];
        for (int64_t i = 0; i < V; ++i) {
          _mm512_store_ps(tmp, acc[g * V + i]);
          for (int64_t j = 0; j < 16; ++j) o[i * 16 + j] = at::BFloat16(tmp[j]);
        }
      }
    }
  });
}
#endif

// q [B, H, D]; kv_cache [2, num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64. Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                           at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "paged_decode: bad ranks");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "paged_decode: q and cache dtypes differ");
  TORCH_CHECK(kv_cache.size(4) <= 256, "paged_decode: head_dim above 256");
  q = q.contiguous();
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(H % KVH == 0, "paged_decode: heads not a multiple of KV heads");
  auto out = at::empty_like(q);
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && D % 32 == 0) {
    const auto* base = kv_cache.data_ptr<at::BFloat16>();
    decode_bf16_avx512(q.data_ptr<at::BFloat16>(), base, base + NB * BS * KVH * D, block_tables.data_ptr<int64_t>(),
                       seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, D, BS,
                       block_tables.size(1), (float)scale);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), base, base + NB * BS * KVH * D, block_tables.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D, BS, block_tables.size(1),
             (float)scale);
    };
    if (D == 64) run(decode_kernel<scalar_t, 64>);
    else if (D == 128) run(decode_kernel<scalar_t, 128>);
    else run(decode_kernel<scalar_t, 0>);
  });
  return out;
}

// New tokens' K and V [T, KVH, D] (any strides with unit last) into the cache at slot_mapping [T]: one
// call for what two index_copy_ and their dtype conversions did.
void write_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && kv_cache.dim() == 5, "write_kv: bad shapes");
  TORCH_CHECK(kv_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1, "write_kv: bad strides");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "write_kv: K/V and cache dtypes differ");
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == KVH && kv_cache.size(4) == D, "write_kv: cache is not [2, blocks, bs, KVH, D]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = NB * BS;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    scalar_t* kc = kv_cache.data_ptr<scalar_t>();
    scalar_t* vc = kc + num_slots * KVH * D;
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        std::copy_n(kp + t * k.stride(0) + h * k.stride(1), D, kc + (slots[t] * KVH + h) * D);
        std::copy_n(vp + t * v.stride(0) + h * v.stride(1), D, vc + (slots[t] * KVH + h) * D);
      }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("write_kv", &write_kv, "store new K/V at their cache slots");
}
