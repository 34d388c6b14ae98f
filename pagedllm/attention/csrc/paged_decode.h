// Decode paged attention on the CPU: one query token per sequence, K/V read in place through the
// block table (no gathered copy of the context). Work is split over (sequence, KV head) tasks; the query
// heads of a GQA group share every K/V load. Accumulates in float whatever the cache dtype. Bound for
// Python by paged_decode.cpp; model/csrc/decode_stack.cpp calls paged_decode and write_kv directly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_decode_bf16.h"

namespace paged {

// softmax of each of `rows` rows of `len` scores, in place
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

// HEAD_DIM > 0 fixes head_dim at compile time (fully unrolled, vectorized inner loops); 0 = any.
// Tasks [begin, end) of the B * KVH (sequence, KV head) pairs. q_stride: elements from one sequence's
// query [H, D] to the next (H * D when contiguous); out is [B, H, D] contiguous. window > 0: only the last
// `window` positions are read (sliding-window attention; the blocks before may be gone from the table);
// softcap > 0: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
template <typename scalar_t, int64_t HEAD_DIM>
void decode_tasks(const scalar_t* q, int64_t q_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int64_t* tables, const int64_t* lens, scalar_t* out, int64_t H, int64_t KVH,
                  int64_t head_dim, int64_t BS, int64_t max_blocks, float scale, int64_t window, float softcap,
                  int64_t begin, int64_t end) {
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : head_dim;
  const int64_t G = H / KVH;
  std::vector<float> qf(G * D), acc(G * D), scores;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / KVH, h = task % KVH;
    const int64_t t0 = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    const int64_t L = lens[b] - t0;  // positions read: t0 .. lens[b] - 1, scores[g * L + t - t0]
    scores.assign(G * L, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = float(q[b * q_stride + (h * G + g) * D + d]) * scale;
    // scores = q . k for every position, through the block table. The kernel waits on memory more
    // than it computes: a sequence's blocks are scattered, so the hardware prefetcher cannot guess the
    // next one; each token's row of the next block (K, and V for the second pass) is asked for ahead.
    const int64_t* table = tables + b * max_blocks;
    for (int64_t t = t0; t < lens[b]; ++t) {
      const int64_t slot = table[t / BS] * BS + t % BS;
      const scalar_t* k = k_cache + (slot * KVH + h) * D;
      if (t + BS < lens[b]) {
        const int64_t ahead = ((table[t / BS + 1] * BS + t % BS) * KVH + h) * D;
        for (int64_t d = 0; d < D; d += 64 / sizeof(scalar_t)) {
          __builtin_prefetch(k_cache + ahead + d, 0, 3);
          __builtin_prefetch(v_cache + ahead + d, 0, 2);
        }
      }
      float kf[256];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) kf[d] = float(k[d]);
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        const float* qg = qf.data() + g * D;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
        scores[g * L + t - t0] = softcap > 0.f ? softcap * std::tanh(s / softcap) : s;
      }
    }
    softmax_rows(scores.data(), G, L);
    // out = p . v
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = t0; t < lens[b]; ++t) {
      const int64_t slot = table[t / BS] * BS + t % BS;
      const scalar_t* v = v_cache + (slot * KVH + h) * D;
      if (t + BS < lens[b])
        for (int64_t d = 0; d < D; d += 64 / sizeof(scalar_t))
          __builtin_prefetch(v_cache + ((table[t / BS + 1] * BS + t % BS) * KVH + h) * D + d, 0, 3);
      float vf[256];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) vf[d] = float(v[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * L + t - t0];
        float* ag = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[(b * H + h * G + g) * D + d] = scalar_t(acc[g * D + d]);
  }
}

// Runs fn(begin, end) over the B * KVH (sequence, KV head) tasks, one contiguous range per thread with
// about equal numbers of positions to read: a decode batch's contexts differ (the W32 prompts are 20 to 294
// tokens), and an equal count of tasks per thread left one thread waiting on the other.
// A second thread only pays above ~320 positions to read per thread (one context of 100 tokens over 3 KV heads:
// 4.9 us on one thread, 7.0 on two; 300 tokens: 12.0 and 10.6).
constexpr int64_t kPositionsPerThread = 320;

template <typename F>
void for_balanced_tasks(const int64_t* lens, int64_t B, int64_t KVH, const F& fn) {
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += (lens[b] + 16) * KVH;  // + 16: a task's fixed cost, in positions
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), B * KVH, total / kPositionsPerThread});
  if (threads <= 1) return fn(0, B * KVH);
  std::vector<int64_t> bounds(threads + 1, B * KVH);
  bounds[0] = 0;
  int64_t done = 0, next = 1;
  for (int64_t task = 0; task < B * KVH && next < threads; ++task) {
    done += lens[task / KVH] + 16;
    while (next < threads && done * threads >= total * next) bounds[next++] = task + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (bounds[t] < bounds[t + 1]) fn(bounds[t], bounds[t + 1]);
  });
}

#ifdef PAGEDLLM_DECODE_BF16
// The bf16 tasks over all B * KVH (sequence, KV head) pairs, on raw pointers (paged_decode below and
// model/csrc/decode_stack.cpp's small steps): q rows q_stride apart, out [B, H, D]. False where no
// instantiation takes this head_dim and group (the generic tasks then run).
inline bool decode_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                        const c10::BFloat16* v_cache, const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, c10::BFloat16* out) {
  const auto kernel = decode_tasks_bf16_for(D, H / KVH);
  if (!kernel) return false;
  // sequences taken in the order of their first block: those that share a cached prefix (the same first
  // blocks) then come one after another on one thread, and the second reads the shared blocks from L2
  // (W32's sharers were 12 rows apart, and the other ~1.8 MB read between them had pushed the blocks out).
  // Each task's arithmetic is unchanged. A captured W32 step's layers, alternated: 28.02 -> 27.74 and
  // 25.73 -> 25.00 ms
  std::vector<int64_t> order(B), ordered_lens(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tables[a * max_blocks] < tables[b * max_blocks]; });
  for (int64_t i = 0; i < B; ++i) ordered_lens[i] = lens[order[i]];
  for_balanced_tasks(ordered_lens.data(), B, KVH, [&](int64_t begin, int64_t end) {
    kernel(q, q_stride, k_cache, v_cache, tables, lens, out, H, KVH, BS, max_blocks, scale, order.data(), begin, end);
  });
  return true;
}
#endif

// q [B, H, D] (each sequence's [H, D] contiguous, rows may be strided); kv_cache [2, num_blocks,
// block_size, KVH, D]; block_tables [B, max_blocks] int64; seq_lens [B] int64. Returns [B, H, D] in q's dtype.
// window > 0: sliding-window attention over the last `window` positions; softcap > 0: Gemma 2's soft-capped
// scores (both 0 for plain attention; the bf16 tasks run plain attention only).
inline at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor seq_lens,
                                double scale, int64_t window = 0, double softcap = 0.0) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "paged_decode: bad ranks");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "paged_decode: q and cache dtypes differ");
  TORCH_CHECK(kv_cache.size(4) <= 256, "paged_decode: head_dim above 256");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();  // [B, H, D] rows may be strided
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(H % KVH == 0, "paged_decode: heads not a multiple of KV heads");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    auto run = [&](auto kernel) {
      for_balanced_tasks(lens, B, KVH, [&](int64_t begin, int64_t end) {
        kernel(q.data_ptr<scalar_t>(), q.stride(0), base, base + NB * BS * KVH * D, block_tables.data_ptr<int64_t>(),
               seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), H, KVH, D, BS, block_tables.size(1),
               (float)scale, window, (float)softcap, begin, end);
      });
    };
#ifdef PAGEDLLM_DECODE_BF16
    // (the casts only keep the other dtypes' instantiations compiling: this branch runs for bf16)
    using bf16 = c10::BFloat16;
    const bf16* k_base = reinterpret_cast<const bf16*>(base);
    if (std::is_same_v<scalar_t, bf16> && window <= 0 && softcap <= 0.0 &&
        decode_bf16(reinterpret_cast<const bf16*>(q.data_ptr<scalar_t>()), q.stride(0), k_base,
                    k_base + NB * BS * KVH * D, block_tables.data_ptr<int64_t>(), block_tables.size(1), lens, B, H,
                    KVH, D, BS, (float)scale, reinterpret_cast<bf16*>(out.data_ptr<scalar_t>())))
      return;
#endif
    if (D == 64) run(decode_tasks<scalar_t, 64>);
    else if (D == 128) run(decode_tasks<scalar_t, 128>);
    else run(decode_tasks<scalar_t, 0>);
  });
  return out;
}

// The copies of write_kv: token t's K head h at k + t * row_stride + h * head_stride (V likewise) into
// the K / V caches at slot slots[t], after checking every slot lies in the cache's num_slots.
template <typename scalar_t>
void write_kv_rows(const scalar_t* k, const scalar_t* v, int64_t k_row, int64_t v_row, int64_t head_stride_k,
                   int64_t head_stride_v, scalar_t* k_cache, scalar_t* v_cache, const int64_t* slots, int64_t T,
                   int64_t KVH, int64_t D, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot out of range");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      std::copy_n(k + t * k_row + h * head_stride_k, D, k_cache + (slots[t] * KVH + h) * D);
      std::copy_n(v + t * v_row + h * head_stride_v, D, v_cache + (slots[t] * KVH + h) * D);
    }
}

// New tokens' K and V [T, KVH, D] (any strides with unit last) into the cache at slot_mapping [T]: one
// call for what two index_copy_ and their dtype conversions did.
inline void write_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && kv_cache.dim() == 5, "write_kv: bad shapes");
  TORCH_CHECK(kv_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1, "write_kv: bad strides");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "write_kv: K/V and cache dtypes differ");
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == KVH && kv_cache.size(4) == D, "write_kv: cache is not [2, blocks, bs, KVH, D]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    scalar_t* kc = kv_cache.data_ptr<scalar_t>();
    write_kv_rows(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k.stride(0), v.stride(0), k.stride(1), v.stride(1),
                  kc, kc + NB * BS * KVH * D, slots, T, KVH, D, NB * BS);
  });
}

}  // namespace paged
