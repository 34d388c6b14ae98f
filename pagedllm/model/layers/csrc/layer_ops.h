// Element-wise pieces of a decoder layer, one call each instead of 4-10 torch ops: on 2 CPU cores a
// decode step's small tensors ([32, 576]) make the per-op dispatch cost, not the arithmetic, the bill.
// Every op rounds where the torch code it replaces rounds (model/layers/*.py), the RMS sum included, so
// bf16 results match it bit for bit. Bound for Python by layer_ops.cpp; model/csrc/decode_stack.cpp calls
// them directly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <vector>

#include "../../../csrc/bf16_vec.h"

namespace layer_ops {

// rows of at least this many elements per task before a second thread is worth waking
constexpr int64_t kGrain = 1 << 14;

#ifdef PAGEDLLM_BF16_VEC
// bf16 rows take bf16_vec.h's 16-lane loops (the same roundings, bit for bit); other dtypes the scalar ones
template <typename scalar_t>
constexpr bool kVector = std::is_same_v<scalar_t, at::BFloat16>;
#else
template <typename scalar_t>
constexpr bool kVector = false;
#endif

inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1)); }

// float(x)^2 per element of a row (ATen's pow(2) is x * x)
template <typename scalar_t>
void squares_row(const scalar_t* x, float* sq, int64_t width) {
#ifdef PAGEDLLM_BF16_VEC
  if constexpr (kVector<scalar_t>) {
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 k = bf16vec::lanes(i, width);
      const __m512 v = bf16vec::load(x + i, k);
      _mm512_mask_storeu_ps(sq + i, k, _mm512_mul_ps(v, v));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < width; ++i) sq[i] = float(x[i]) * float(x[i]);
}

// o = dtype(float(a) <op> float(b)) per element of a row (o may be b), as a torch op on two bf16 tensors
// rounds it; op is plus or multiplies (the same op on float lanes and on floats)
template <typename scalar_t, typename Op>
void combine_row(const scalar_t* a, const scalar_t* b, scalar_t* o, int64_t width, Op op) {
#ifdef PAGEDLLM_BF16_VEC
  if constexpr (kVector<scalar_t>) {
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 k = bf16vec::lanes(i, width);
      bf16vec::store(o + i, k, op(bf16vec::load(a + i, k), bf16vec::load(b + i, k)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < width; ++i) o[i] = scalar_t(op(float(a[i]), float(b[i])));
}

// The float32 sum of n values as ATen's sum kernel adds a contiguous row (SumKernel.cpp, as dispatched
// on x86: 8-lane vectors): vector v's lanes go to accumulator v % 4, cascaded through 4 levels every
// 2^max(4, ceil(log2(n / 32)) / 4) rows of 4 vectors; then accumulators 1-3 into 0, the leftover
// elements, and the 8 lanes, in order (fewer than 8 values: the same over scalars). x.pow(2).mean(-1)
// is this sum divided by n, so an RMSNorm here rounds as torch's does without calling ATen's reduction,
// which cost more than the norm (a tensor of squares, an iterator, a thread hand-off). Any other order
// moves a bf16 result by an ulp now and then, and a greedy token with it; tests/test_cpu_kernels.py holds
// it to torch's mean bit for bit over widths 1-300 and model widths up to 14,336.
// LANES floats as one value (GCC's vector extension: lane-wise adds, as Vectorized<float>'s); 1: a float
template <int LANES>
struct FloatLanes {
  typedef float type __attribute__((vector_size(LANES * sizeof(float))));
};
template <>
struct FloatLanes<1> {
  using type = float;
};

template <int LANES = 8>
float sum_like_aten(const float* x, int64_t n) {
  if constexpr (LANES > 1)
    if (n < LANES) return sum_like_aten<1>(x, n);
  using Vec = typename FloatLanes<LANES>::type;
  auto load = [x](int64_t v) {
    Vec r;
    __builtin_memcpy(&r, x + v * LANES, sizeof(Vec));
    return r;
  };
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t vecs = n / LANES, rows = vecs / kIlp;
  const int64_t bits = rows <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(rows - 1));  // ceil(log2(rows))
  const int64_t level_power = std::max<int64_t>(4, bits / kLevels);
  const int64_t step = int64_t(1) << level_power, mask = step - 1;
  Vec acc[kLevels][kIlp] = {};
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) acc[0][k] += load(kIlp * i + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = Vec{};
      }
      if ((i & (mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < kIlp; ++k) acc[0][k] += load(kIlp * i + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k] += acc[j][k];
  for (int64_t v = rows * kIlp; v < vecs; ++v) acc[0][0] += load(v);
  for (int k = 1; k < kIlp; ++k) acc[0][0] += acc[0][k];
  float total = 0.f;
  for (int64_t e = vecs * LANES; e < n; ++e) total += x[e];
  if constexpr (LANES == 1)
    total += acc[0][0];
  else
    for (int l = 0; l < LANES; ++l) total += acc[0][0][l];
  return total;
}

// mean(float(x)^2) of one row, as x.float().pow(2).mean(-1) computes it (ATen's pow(2) is x * x)
template <typename scalar_t>
float mean_of_squares_row(const scalar_t* x, float* sq, int64_t width) {
  squares_row(x, sq, width);
  return sum_like_aten(sq, width) / float(width);
}

// out = weight * dtype(x * rsqrt(mean(x^2) + eps)) for one row; sq: width floats of scratch
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* o, float* sq, int64_t width, float eps) {
  const float inv = 1.f / std::sqrt(mean_of_squares_row(x, sq, width) + eps);
#ifdef PAGEDLLM_BF16_VEC
  if constexpr (kVector<scalar_t>) {
    const __m512 inv_v = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 k = bf16vec::lanes(i, width);
      const __m512 normed = bf16vec::round(_mm512_mul_ps(bf16vec::load(x + i, k), inv_v));
      bf16vec::store(o + i, k, _mm512_mul_ps(bf16vec::load(weight + i, k), normed));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < width; ++i) o[i] = scalar_t(float(weight[i]) * float(scalar_t(float(x[i]) * inv)));
}

// fn(begin, end, scratch) over rows, on several threads only where there is enough work to pay for
// waking them; scratch holds `width` floats
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& fn) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(width);
    fn(begin, end, scratch.data());
  });
}

// mean(float(x)^2) per row of x [rows, width], float32 [rows]: what the norms use, bound for the tests
inline at::Tensor mean_of_squares(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "mean_of_squares: x must be [rows, width] with unit column stride");
  const int64_t rows = x.size(0), width = x.size(1), xs = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mean_of_squares", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    float* o = out.data_ptr<float>();
    for_rows(rows, width, [&](int64_t begin, int64_t end, float* sq) {
      for (int64_t r = begin; r < end; ++r) o[r] = mean_of_squares_row(xp + r * xs, sq, width);
    });
  });
  return out;
}

inline at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, width] with unit column stride");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x dtypes differ");
  weight = weight.contiguous();
  const int64_t rows = x.size(0), width = x.size(1), xs = x.stride(0);
  auto out = at::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for_rows(rows, width, [&](int64_t begin, int64_t end, float* sq) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * xs, w, o + r * width, sq, width, (float)eps);
    });
  });
  return out;
}

// Returns (residual + x rounded to the dtype, rms_norm of that sum): the skip connection for the rest of
// the layer and the next block's input.
inline std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "add_rms_norm: x must be [rows, width] with unit column stride");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual must have x's shape");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(), "add_rms_norm: dtypes differ");
  weight = weight.contiguous();
  residual = residual.contiguous();
  auto sum = at::empty_like(residual);
  auto out = at::empty_like(residual);
  const int64_t rows = x.size(0), width = x.size(1), xs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for_rows(rows, width, [&](int64_t begin, int64_t end, float* sq) {
      for (int64_t r = begin; r < end; ++r) {
        combine_row(xp + r * xs, rp + r * width, sp + r * width, width, std::plus<>());
        rms_norm_row(sp + r * width, w, o + r * width, sq, width, (float)eps);
      }
    });
  });
  return {sum, out};
}

#ifdef PAGEDLLM_BF16_VEC
// ATen's Vectorized<float>::exp on AVX-512; libtorch_cpu exports it, so silu here calls the very function
// at::silu's vectorized loop calls
extern "C" __m512 Sleef_expf16_u10(__m512);

// One row of silu(gate) * up in bf16, rounded as torch rounds F.silu(gate) * up: ATen's silu kernel takes
// the row 64 values at a time as float x / (1 + exp(-x)) with Sleef's exp, the last width % 64 one by one
// with std::exp, and rounds each to bf16; then the product in float, rounded again. (ATen's vector loop
// writes a NaN as 0xFFFF where c10 writes 0x7FC0; either is a NaN, and the product's rounding below
// writes 0x7FC0 whatever came in.) Calling at::silu instead cost ~10 us a row (an op, an output tensor, a thread hand-off):
// 0.3 ms of a 5 ms single-stream step.
inline void silu_mul_row(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t width) {
  const int64_t vector_end = width / 64 * 64;
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (int64_t i = 0; i < vector_end; i += 16) {
    const __m512 x = bf16vec::load(gate + i, 0xFFFF);
    const __m512 silu = bf16vec::round(_mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(x, sign)))));
    bf16vec::store(out + i, 0xFFFF, _mm512_mul_ps(bf16vec::load(up + i, 0xFFFF), silu));
  }
  for (int64_t i = vector_end; i < width; ++i) {
    const float x = float(gate[i]);
    const at::BFloat16 silu(x / (1.0f + std::exp(-x)));
    out[i] = at::BFloat16(float(up[i]) * float(silu));
  }
}
#endif

// gate_up [rows, 2F] (gate, then up) -> dtype(silu(gate)) * up [rows, F]: SwiGLU's element-wise half
// (bf16: silu_mul_row; other dtypes: ATen's silu, then the product)
inline at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [rows, 2F]");
  if (gate_up.stride(1) != 1) gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), F = gate_up.size(1) / 2;
#ifdef PAGEDLLM_BF16_VEC
  if (gate_up.scalar_type() == at::kBFloat16) {
    auto out = at::empty({rows, F}, gate_up.options());
    const at::BFloat16* g = gate_up.data_ptr<at::BFloat16>();
    at::BFloat16* o = out.data_ptr<at::BFloat16>();
    const int64_t gs = gate_up.stride(0);
    at::parallel_for(0, rows, row_grain(F), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(g + r * gs, g + r * gs + F, o + r * F, F);
    });
    return out;
  }
#endif
  auto out = at::silu(gate_up.narrow(1, 0, F)).contiguous();
  auto up = gate_up.narrow(1, F, F);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    const int64_t us = up.stride(0);
    at::parallel_for(0, rows, row_grain(F), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) combine_row(u + r * us, o + r * F, o + r * F, F, std::multiplies<>());
    });
  });
  return out;
}

// Rotary embedding ("rotate half" layout) in place on x [T, heads, D] (any row stride, unit last stride);
// cos/sin [T, D] in x's dtype. Rounds like q*cos + rotate_half(q)*sin does in torch: each product, then
// the sum.
template <typename scalar_t>
void rotary_rows(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t T, int64_t H, int64_t D,
                        int64_t s0, int64_t s1) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, row_grain(H * D), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cos + t * D;
      const scalar_t* s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) {
        scalar_t* v = x + t * s0 + h * s1;
#ifdef PAGEDLLM_BF16_VEC
        if constexpr (kVector<scalar_t>) {
          if (half % 16 == 0 && D <= 256) {  // whole 16-lane chunks on either side of the half
            __m512 res[16];
            for (int64_t i = 0; i < D; i += 16) {
              const __m512 rot = i < half ? _mm512_sub_ps(_mm512_setzero_ps(), bf16vec::load(v + i + half, 0xFFFF))
                                          : bf16vec::load(v + i - half, 0xFFFF);
              const __m512 a = bf16vec::round(_mm512_mul_ps(bf16vec::load(v + i, 0xFFFF), bf16vec::load(c + i, 0xFFFF)));
              const __m512 b = bf16vec::round(_mm512_mul_ps(rot, bf16vec::load(s + i, 0xFFFF)));
              res[i / 16] = _mm512_add_ps(a, b);
            }
            for (int64_t i = 0; i < D; i += 16) bf16vec::store(v + i, 0xFFFF, res[i / 16]);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < D; ++i) {
          const float rot = i < half ? -float(v[i + half]) : float(v[i - half]);
          const scalar_t a = scalar_t(float(v[i]) * float(c[i]));
          const scalar_t b = scalar_t(rot * float(s[i]));
          tmp[i] = float(a) + float(b);
        }
        for (int64_t i = 0; i < D; ++i) v[i] = scalar_t(tmp[i]);
      }
    }
  });
}

inline void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, D] with unit last stride");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rotary: dtypes differ");
  cos = cos.reshape({x.size(0), x.size(2)}).contiguous();
  sin = sin.reshape({x.size(0), x.size(2)}).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), x.size(0),
                          x.size(1), x.size(2), x.stride(0), x.stride(1));
  });
}

}  // namespace layer_ops
