// The `lora` op's C++ backend (lora/punica.py names the op): every row's adapter product added to the base
// linear's output, y += B_s (A_s x) for row t of adapter slot s, in place. A header so that the fused decoder
// stack (model/csrc/decode_stack.cpp) adds adapters to its linears with the same code as the layer loop.
//
// Layout (lora/layers.py keeps it; punica.py's docstring draws it): a linear's adapters stacked over the S
// slots and its n output slices, R = max_lora_rank rows each,
//     a   [S * n * R, in]   slot s, slice i at rows (s * n + i) * R ...
//     b_t [S * n * R, out]  B transposed, the scaling folded in; slice i's rows hold only its own output
//                           columns (widths[i] of them, side by side): the rest of the row is zeros
// row_slots [T] int64: each row's slot, -1 for a base row (nothing added).
//
// Why not the reference's masked product ((x A^T) * mask) B_t: it computes every used slot for every row and
// reads B_t's zeros, and a decode step's two small GEMMs a linear cost more in dispatch than in arithmetic
// (the fused stack cannot call them at all). Here a row reads only its own slot's A rows and each slice's
// own block of B_t: for a 135M model's rank-16 adapter on all seven linears that is 163k weights a layer
// against the dense product's 242k. In float32 (the adapters' own numbers; a bf16 copy for 16-bit models,
// where it halves the bytes a decode step streams): h = A_s x accumulated in float32, then out = B_t^T h in
// float32, rounded once to y's dtype and added as the reference's `y + delta.to(y.dtype)` does.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lora {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  uint32_t bits = uint32_t(v.x) << 16;  // exact: bf16 is float32's top half
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 dot product of x (already float32) with one weight row
template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += x[k] * to_float(w[k]);
  return acc;
}

// out[c] += h * w[c] for c < n
template <typename W>
inline void axpy(float h, const W* w, float* out, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] += h * to_float(w[c]);
}

// Output columns a task of the expand covers (its sums stay in registers: 4 AVX-512 or 8 AVX2 vectors)
constexpr int64_t kColumnChunk = 64;
// Below this many multiply-adds a call runs on one thread: a decode step's adapter product (a 576-wide
// model's gate_up: 68k) takes a few microseconds, about what waking the other threads costs
constexpr int64_t kParallelMacs = 1 << 14;

// h[g][q] = dot(x[g], w row q) for G rows of one slot and 4 adapter rows `stride` apart: G x 4 sums of 16
// lanes each, every weight vector loaded once for the G rows (the tail past a multiple of 16 one by one)
template <int G, typename W>
inline void shrink_quad(const float* const* x, const W* w, int64_t stride, int64_t K, float* const* h) {
  constexpr int64_t L = 16;
  float acc[G][4][L] = {};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if (sizeof(W) == 4 || k % 32 == 0)  // each cache line of the weights once, 512 B ahead
      for (int q = 0; q < 4; ++q) __builtin_prefetch(reinterpret_cast<const char*>(w + q * stride + k) + 512);
    float wv[4][L];
    for (int q = 0; q < 4; ++q)
#pragma omp simd
      for (int64_t c = 0; c < L; ++c) wv[q][c] = to_float(w[q * stride + k + c]);
    for (int g = 0; g < G; ++g)
      for (int q = 0; q < 4; ++q)
#pragma omp simd
        for (int64_t c = 0; c < L; ++c) acc[g][q][c] += x[g][k + c] * wv[q][c];
  }
  for (int g = 0; g < G; ++g)
    for (int q = 0; q < 4; ++q) {
      float sum = 0.f;
      for (int64_t c = 0; c < L; ++c) sum += acc[g][q][c];
      for (int64_t kk = k; kk < K; ++kk) sum += x[g][kk] * to_float(w[q * stride + kk]);
      h[g][q] = sum;
    }
}

// Rows of one slot that an expand task takes together: each B_t vector loaded serves all of them
constexpr int64_t kRowGroup = 4;

// out[g][0, kColumnChunk) += sum_r h[g][r] * b[r * N + c] for G rows of one slot and a whole chunk of one
// slice's columns: G x 64 sums in registers, each B_t vector loaded once for the G rows
template <int G, typename W>
inline void expand_chunk(const float* const* h, const W* b, int64_t N, int64_t rank, float (*out)[kColumnChunk]) {
  float acc[G][kColumnChunk] = {};
  for (int64_t r = 0; r < rank; ++r) {
    const W* br = b + r * N;
    // the next chunk's part of this row: the rows are N apart, too far for the hardware prefetcher
    for (int64_t line = 0; line < kColumnChunk * int64_t(sizeof(W)); line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(br + kColumnChunk) + line);
    float hr[G];
    for (int g = 0; g < G; ++g) hr[g] = h[g][r];
#pragma omp simd
    for (int64_t c = 0; c < kColumnChunk; ++c) {
      const float bv = to_float(br[c]);
      for (int g = 0; g < G; ++g) acc[g][c] += hr[g] * bv;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < kColumnChunk; ++c) out[g][c] += acc[g][c];
}

template <typename X, typename W>
void add_lora_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                   const int64_t* slots, int64_t rank, const std::vector<int64_t>& widths) {
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), n = int64_t(widths.size()), nr = n * rank;
  std::vector<int64_t> offsets(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + widths[i];
  const X* xs = x.data_ptr<X>();
  X* ys = y.data_ptr<X>();
  const W* as = a.data_ptr<W>();
  const W* bs = b_t.data_ptr<W>();
  // buffers kept across calls (a decode step makes ~4 calls a layer): x in float32, the shrink's sums,
  // the rows with an adapter. The calling thread's: the parallel region below reaches them through
  // pointers (a thread_local named inside it would be each OpenMP thread's own, empty one)
  thread_local std::vector<float> xf_buf, h_buf;
  thread_local std::vector<int64_t> rows_buf, groups_buf;
  rows_buf.clear();
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) rows_buf.push_back(t);
  const int64_t R = int64_t(rows_buf.size()), chunks = (N + kColumnChunk - 1) / kColumnChunk, quads = (nr + 3) / 4;
  if (R == 0) return;
  // the expand's row groups: the rows ordered by slot, cut into runs of at most kRowGroup of one slot
  std::stable_sort(rows_buf.begin(), rows_buf.end(), [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
  groups_buf.clear();
  for (int64_t i = 0; i < R; ++i)
    if (i == 0 || slots[rows_buf[i]] != slots[rows_buf[i - 1]] || i - groups_buf.back() == kRowGroup)
      groups_buf.push_back(i);
  groups_buf.push_back(R);
  const int64_t num_groups = int64_t(groups_buf.size()) - 1;
  const int64_t* const groups = groups_buf.data();
  if (int64_t(xf_buf.size()) < T * K) xf_buf.resize(T * K);
  if (int64_t(h_buf.size()) < T * nr) h_buf.resize(T * nr);
  float* const xf = xf_buf.data();
  float* const h = h_buf.data();
  const int64_t* const rows = rows_buf.data();
  const int64_t threads = R * (nr * K + rank * N) < kParallelMacs ? 1 : std::min<int64_t>(at::get_num_threads(), R * nr);
  for (int64_t i = 0; i < R; ++i) {  // x in float32: a pass over T x K, beside the shrink's T x n R x K
    const int64_t t = rows[i];
    for (int64_t k = 0; k < K; ++k) xf[t * K + k] = to_float(xs[t * K + k]);
  }
  // one parallel region: shrink (row group x 4 adapter rows), a barrier, expand (row group x column chunks)
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_groups * quads; ++task) {  // a row group x 4 adapter rows (fewer: last)
      const int64_t g0 = groups[task / quads], G = groups[task / quads + 1] - g0, j = task % quads * 4;
      const W* w = as + (slots[rows[g0]] * nr + j) * K;
      const float* xg[kRowGroup];
      float* hg[kRowGroup];
      for (int64_t g = 0; g < G; ++g) xg[g] = xf + rows[g0 + g] * K, hg[g] = h + rows[g0 + g] * nr + j;
      if (j + 4 > nr) {
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = j; i < nr; ++i) hg[g][i - j] = dot(xg[g], w + (i - j) * K, K);
        continue;
      }
      switch (G) {
        case 1: shrink_quad<1>(xg, w, K, K, hg); break;
        case 2: shrink_quad<2>(xg, w, K, K, hg); break;
        case 3: shrink_quad<3>(xg, w, K, K, hg); break;
        default: shrink_quad<4>(xg, w, K, K, hg); break;
      }
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_groups * chunks; ++task) {
      const int64_t g0 = groups[task / chunks], G = groups[task / chunks + 1] - g0;
      const int64_t c0 = (task % chunks) * kColumnChunk, c1 = std::min(N, c0 + kColumnChunk);
      const int64_t slot = slots[rows[g0]];
      float out[kRowGroup][kColumnChunk] = {};
      for (int64_t i = 0; i < n; ++i) {  // the slices this chunk's columns fall in
        const int64_t lo = std::max(c0, offsets[i]), hi = std::min(c1, offsets[i + 1]);
        if (lo >= hi) continue;
        const float* hg[kRowGroup];
        for (int64_t g = 0; g < G; ++g) hg[g] = h + rows[g0 + g] * nr + i * rank;
        const W* b = bs + (slot * nr + i * rank) * N + lo;
        if (hi - lo == kColumnChunk) {  // a whole chunk in one slice (the usual case): sums in registers
          switch (G) {
            case 1: expand_chunk<1>(hg, b, N, rank, out); break;
            case 2: expand_chunk<2>(hg, b, N, rank, out); break;
            case 3: expand_chunk<3>(hg, b, N, rank, out); break;
            default: expand_chunk<4>(hg, b, N, rank, out); break;
          }
        } else {
          for (int64_t g = 0; g < G; ++g)
            for (int64_t r = 0; r < rank; ++r) axpy(hg[g][r], b + r * N, out[g] + (lo - c0), hi - lo);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        X* yt = ys + rows[g0 + g] * N;
        for (int64_t c = c0; c < c1; ++c) yt[c] = X(to_float(yt[c]) + to_float(X(out[g][c - c0])));
      }
    }
  }
}

// y [T, out] += every row's adapter product; x [T, in] of y's dtype (float32 or bf16); a, b_t float32 or bf16
// (one dtype); row_slots [T] int64; widths: the slices' output widths (summing to out). Checked by the caller
// for shapes; types checked here.
inline void add_lora_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                      const at::Tensor& row_slots, int64_t rank, const std::vector<int64_t>& widths) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type(),
              "lora: x [T, in] and y [T, out] of one dtype");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && b_t.is_contiguous(),
              "lora: x, y, a and b_t must be contiguous");
  TORCH_CHECK(a.scalar_type() == b_t.scalar_type() && a.size(1) == x.size(1) && b_t.size(1) == y.size(1) &&
                  a.size(0) == b_t.size(0),
              "lora: a [rows, in] and b_t [rows, out] of one dtype, matching x and y");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() && row_slots.numel() == x.size(0),
              "lora: row_slots [T] int64");
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  TORCH_CHECK(total == y.size(1) && rank > 0 && a.size(0) % (rank * int64_t(widths.size())) == 0,
              "lora: the slices' widths must sum to out, and a's rows be slots x slices x rank");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  const int64_t num_slots = a.size(0) / (rank * int64_t(widths.size()));
  for (int64_t t = 0; t < row_slots.numel(); ++t)
    TORCH_CHECK(slots[t] < num_slots, "lora: row ", t, " names slot ", slots[t], " of ", num_slots);
  const bool bf16_x = x.scalar_type() == at::kBFloat16, bf16_w = a.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16_x || x.scalar_type() == at::kFloat, "lora: x must be float32 or bf16");
  TORCH_CHECK(bf16_w || a.scalar_type() == at::kFloat, "lora: a and b_t must be float32 or bf16");
  if (bf16_x && bf16_w) add_lora_impl<c10::BFloat16, c10::BFloat16>(y, x, a, b_t, slots, rank, widths);
  else if (bf16_x) add_lora_impl<c10::BFloat16, float>(y, x, a, b_t, slots, rank, widths);
  else if (bf16_w) add_lora_impl<float, c10::BFloat16>(y, x, a, b_t, slots, rank, widths);
  else add_lora_impl<float, float>(y, x, a, b_t, slots, rank, widths);
}

}  // namespace lora
