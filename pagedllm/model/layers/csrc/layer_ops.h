// Element-wise pieces of a decoder layer, one call each instead of 4-10 torch ops: on 2 CPU cores a
// decode step's small tensors ([32, 576]) make the per-op dispatch cost, not the arithmetic, the bill.
// Every op rounds where the torch code it replaces rounds (model/layers/*.py), so bf16 results match
// it except the order of the RMS sum. Bound for Python by layer_ops.cpp; model/csrc/decode_stack.cpp calls
// them directly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

// o = dtype(float(a) <op> float(o)) per element of a row, as a torch op on two bf16 tensors rounds it;
// op is plus or multiplies (the same op on float lanes and on floats)
template <typename scalar_t, typename Op>
void combine_row(const scalar_t* a, scalar_t* o, int64_t width, Op op) {
#ifdef PAGEDLLM_BF16_VEC
  if constexpr (kVector<scalar_t>) {
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 k = bf16vec::lanes(i, width);
      bf16vec::store(o + i, k, op(bf16vec::load(a + i, k), bf16vec::load(o + i, k)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < width; ++i) o[i] = scalar_t(op(float(a[i]), float(o[i])));
}

// out = weight * dtype(x * rsqrt(mean(x^2) + eps)) per row. The mean of squares comes from ATen's own
// reduction (pow, then mean, in float32), so its summation order, and with it every rounding, is the
// torch code's: a different order moves bf16 results by an ulp now and then, and a greedy token with
// them.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const float* mean_sq, const scalar_t* weight, scalar_t* out,
                          int64_t rows, int64_t width, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      const float inv = 1.f / std::sqrt(mean_sq[r] + eps);
      scalar_t* o = out + r * width;
#ifdef PAGEDLLM_BF16_VEC
      if constexpr (kVector<scalar_t>) {
        const __m512 inv_v = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < width; i += 16) {
          const __mmask16 k = bf16vec::lanes(i, width);
          const __m512 normed = bf16vec::round(_mm512_mul_ps(bf16vec::load(xr + i, k), inv_v));
          bf16vec::store(o + i, k, _mm512_mul_ps(bf16vec::load(weight + i, k), normed));
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < width; ++i) o[i] = scalar_t(float(weight[i]) * float(scalar_t(float(xr[i]) * inv)));
    }
  });
}

// mean(float(x)^2) per row, as x.float().pow(2).mean(-1) computes it: the squares are the same float
// products (ATen's pow(2) is x * x), made here in one pass instead of a conversion and a pow, and the
// mean is ATen's own reduction over them.
inline at::Tensor mean_of_squares(const at::Tensor& x) {
  const int64_t rows = x.size(0), width = x.size(1), xs = x.stride(0);
  auto squares = at::empty({rows, width}, x.options().dtype(at::kFloat));
  float* sq = squares.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mean_of_squares", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) squares_row(xp + r * xs, sq + r * width, width);
    });
  });
  return squares.mean(-1);
}

inline at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, width] with unit column stride");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x dtypes differ");
  weight = weight.contiguous();
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto ms = mean_of_squares(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), ms.data_ptr<float>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0), (float)eps);
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
  auto sum = residual.contiguous();
  sum = sum.is_same(residual) ? sum.clone() : sum;
  auto out = at::empty_like(sum);
  const int64_t rows = x.size(0), width = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) combine_row(xp + r * xs, sp + r * width, width, std::plus<>());
    });
  });
  auto ms = mean_of_squares(sum);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(sum.data_ptr<scalar_t>(), ms.data_ptr<float>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), rows, width, width, (float)eps);
  });
  return {sum, out};
}

// gate_up [rows, 2F] (gate first) -> dtype(silu(gate)) * up, [rows, F]: SwiGLU's element-wise half.
// silu itself is ATen's (vectorized exp; the same values as F.silu), the product is fused here.
inline at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [rows, 2F]");
  if (gate_up.stride(1) != 1) gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), F = gate_up.size(1) / 2;
  auto out = at::silu(gate_up.narrow(1, 0, F)).contiguous();
  auto up = gate_up.narrow(1, F, F);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    const int64_t us = up.stride(0);
    at::parallel_for(0, rows, row_grain(F), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) combine_row(u + r * us, o + r * F, F, std::multiplies<>());
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
