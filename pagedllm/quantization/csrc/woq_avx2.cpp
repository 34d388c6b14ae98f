// Bindings of the AVX2 weight-only quantized matmul (woq_avx2.h) for quantization/avx2.py.
#include <torch/csrc/utils/pybind.h>

#include "woq_avx2.h"

using woq_avx2::kBlock;
using woq_avx2::kCols;

// x [M, K] float32 or bf16, contiguous; codes / scales / mins in avx2.pack's layout; bias float32 [N] or None.
// avx2.matmul checks the same with Python errors first; these guard direct use. Returns the bias as float32.
static at::Tensor check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& mins, const c10::optional<at::Tensor>& bias, int64_t bits,
                             int64_t group_size, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "woq_avx2: x must be [M, K] float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous(), "woq_avx2: x must be contiguous");
  TORCH_CHECK(bits == 4 || bits == 8 || (bits == 6 && group_size == 16),
              "woq_avx2: bits must be 4 or 8 (6: GGUF Q6_K's codes, group 16)");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kCols - 1) / kCols;
  TORCH_CHECK(M >= 1 && N >= 1, "woq_avx2: needs M >= 1 and N >= 1");
  TORCH_CHECK(K % kBlock == 0 && group_size > 0 && (group_size % kBlock == 0 || (bits >= 6 && group_size == 16)) &&
                  K % group_size == 0,
              "woq_avx2: needs K a multiple of 32, the group size a multiple of 32 (or 16 with 8-bit codes), K a "
              "multiple of the group size");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(0) == panels && codes.size(1) == K / kBlock && codes.size(2) == bits * 32,
              "woq_avx2: codes do not match x's K, N and bits");
  // mins: their own tensor in the scales' form, or one float32 factor c (mins = c x scales: woq_avx2::mins_ref)
  const bool derived = mins.numel() == 1;
  TORCH_CHECK(!derived || mins.scalar_type() == at::kFloat, "woq_avx2: a derived mins factor must be float32");
  if (bits == 6)
    TORCH_CHECK(derived && mins.item<float>() == -32.f, "woq_avx2: the 6-bit (Q6_K) layout's mins are -32 x its scales");
  TORCH_CHECK(scales.is_contiguous() && (derived || (scales.scalar_type() == mins.scalar_type() &&
                                                     scales.sizes() == mins.sizes() && mins.is_contiguous())),
              "woq_avx2: scales and mins must be contiguous and of one form");
  const int64_t groups = K / group_size;
  if (scales.scalar_type() == at::kByte) {  // two-level: [panels, groups / sb, 16 + 8 sb] (woq_avx2::scale_ref)
    const woq_avx2::ScaleRef ref = woq_avx2::scale_ref(scales);
    TORCH_CHECK(scales.size(0) == panels && groups % (int64_t(1) << ref.shift) == 0 &&
                    scales.size(1) == groups >> ref.shift,
                "woq_avx2: two-level scales / mins do not match the shape");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf,
                "woq_avx2: scales and mins must be float32, float16 or two-level uint8");
    TORCH_CHECK(scales.numel() == panels * groups * kCols, "woq_avx2: scales / mins do not match the shape");
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "woq_avx2: bias must have N elements");
  }
  return b;
}

// Returns x @ W^T (+ bias) as [M, N] in x's dtype.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group_size, int64_t N) {
  const at::Tensor b = check_args(x, codes, scales, mins, bias, bits, group_size, N);
  return woq_avx2::matmul_tensor(x, codes, scales, mins, b, bits, group_size, N);
}

// The float32-activation alternative for one float32 row (woq_avx2.h's panel_fp32), for measurement.
at::Tensor gemv_fp32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group_size, int64_t N) {
  const at::Tensor b = check_args(x, codes, scales, mins, bias, bits, group_size, N);
  TORCH_CHECK(x.size(0) == 1 && x.scalar_type() == at::kFloat, "woq_avx2: gemv_fp32 takes one float32 row");
  TORCH_CHECK(group_size % kBlock == 0, "woq_avx2: gemv_fp32 takes groups that are multiples of 32");
  at::Tensor out = at::empty({1, N}, x.options());
  const woq_avx2::ScaleRef sc = woq_avx2::scale_ref(scales);
  woq_avx2::gemv_fp32_into(x.data_ptr<float>(), x.size(1), codes.data_ptr<uint8_t>(), sc,
                           woq_avx2::mins_ref(mins, sc), bits, group_size,
                           b.defined() ? b.data_ptr<float>() : nullptr, N, out.data_ptr<float>());
  return out;
}

// The inputs x is rounded over for a GGUF K-quant's two-level layout in this build: Q4_K (bits 4) or Q6_K
// (bits 6): a super-block (woq_avx2::x_span) where the pairs kernel does not take the layer, else a 32-block.
int64_t k_quant_x_span(int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 6, "woq_avx2: k_quant_x_span takes bits 4 (Q4_K) or 6 (Q6_K)");
  const bool half = bits == 6;  // Q6_K: 16 groups of 16 a super-block; Q4_K: 8 of 32
  const int shift = __builtin_ctzll(half ? 2 * woq_avx2::kQ6SpanBlocks : woq_avx2::kSpanGroups);
  woq_avx2::ScaleRef two_level{woq_avx2::ScaleRef::kTwoLevel, nullptr, shift};
  const int64_t span = woq_avx2::x_span(bits, half, half, two_level);
  return span ? span : woq_avx2::kBlock;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("k_quant_x_span", &k_quant_x_span, "inputs x is rounded over for Q4_K's / Q6_K's two-level layout (256 or 32)");
  m.def("matmul", &matmul, "x @ (scales * q + mins)^T (+ bias) with int8 activations per 32-block (Q4_K, Q6_K: k_quant_x_span), AVX2");
  m.def("gemv_fp32", &gemv_fp32, "the same for one float32 row with float32 activations (for comparison)");
}
