// Greedy sampling's argmax over a decode step's logits [B, V] (bf16 or float32), bound for Python
// (worker/sampler.py): the first index of each row's maximum, a NaN counting as the maximum (its first
// one), which is what torch.max(dim=-1).indices picks.
//
// Why: ATen's max(dim) reads [32, 49152] bf16 logits in ~0.57 ms on 2 threads, and the float32 copy the
// sampler otherwise makes costs another ~0.18 ms: ~3% of a W32 decode step for 3 MB. Here 16 lanes keep
// their own running maximum and its first index, and the lanes are merged at the end of the row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "../../csrc/bf16_vec.h"  // PAGEDLLM_BF16_VEC where AVX-512 is there: bf16vec::load

namespace {

// the first index of the maximum of x[begin, end), a NaN winning; also returns that value
template <typename scalar_t>
int64_t argmax_scalar(const scalar_t* x, int64_t begin, int64_t end, float& best) {
  int64_t at = begin;
  best = float(x[begin]);
  if (std::isnan(best)) return at;
  for (int64_t i = begin + 1; i < end; ++i) {
    const float v = float(x[i]);
    if (std::isnan(v)) {
      best = v;
      return i;
    }
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return at;
}

#ifdef PAGEDLLM_BF16_VEC
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) { return bf16vec::load(x, 0xFFFF); }  // exact: the bits, shifted
#endif

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t V) {
  int64_t i = 0;
#ifdef PAGEDLLM_BF16_VEC
  if (V >= 16) {
    __m512 best = load16(x);
    __m512i best_at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i at = best_at;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V && !nan; i += 16) {
      at = _mm512_add_epi32(at, step);
      const __m512 v = load16(x + i);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: ties keep the first
      best = _mm512_mask_mov_ps(best, greater, v);
      best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    }
    if (nan) {  // the first NaN lies in the chunk just read, [i - 16, i)
      for (int64_t j = i - 16;; ++j)
        if (std::isnan(float(x[j]))) return j;
    }
    // the lanes' maxima: the largest value, and the first index among the lanes that hold it
    const float m = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    const int64_t first = _mm512_mask_reduce_min_epi32(holders, best_at);
    if (i == V) return first;
    float tail_best;
    const int64_t tail = argmax_scalar(x, i, V, tail_best);
    return std::isnan(tail_best) || tail_best > m ? tail : first;
  }
#endif
  float unused;
  return argmax_scalar(x, i, V, unused);
}

// logits [B, V] (bf16 or float32) with unit last stride -> int64 [B]
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be [rows, vocab] with unit last stride");
  TORCH_CHECK(logits.size(1) < std::numeric_limits<int32_t>::max(), "argmax_rows: vocab above 2^31");
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto run = [&](auto* x) {
    at::parallel_for(0, B, std::max<int64_t>(1, (int64_t(1) << 16) / V), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) o[b] = argmax_row(x + b * stride, V);
    });
  };
  if (logits.scalar_type() == at::kBFloat16)
    run(logits.data_ptr<c10::BFloat16>());
  else if (logits.scalar_type() == at::kFloat)
    run(logits.data_ptr<float>());
  else
    TORCH_CHECK(false, "argmax_rows: logits must be bf16 or float32");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (a NaN counting as the maximum)");
}
