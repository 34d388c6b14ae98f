// Bindings of the weight-only quantized matmuls (woq_amx.h: AMX tiles; woq_gemv.h: 1-8 rows) for
// quantization/amx.py, and the one-time request for the AMX tile state.
#include <torch/csrc/utils/pybind.h>

#include "woq_amx.h"
#include "woq_gemv.h"

#include <sys/syscall.h>
#include <unistd.h>

using woq::kKStep;
using woq::kTile;

namespace {

// Linux hands out the AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("avx512bf16"))
    return false;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
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
  const int64_t groups = K / group_size;
  TORCH_CHECK(codes.numel() == N * K * bits / 8, "woq_amx: the codes do not match the shape");
  if (scales.scalar_type() == at::kByte) {  // two-level: [N/16, groups / sb, 32 + 16 sb], sb a power of two
    const int64_t sb = scales.dim() == 3 ? (scales.size(2) - 32) / kTile : 0;
    TORCH_CHECK(sb > 0 && (sb & (sb - 1)) == 0 && groups % sb == 0 && scales.size(0) == N / kTile &&
                    scales.size(1) == groups / sb && scales.size(2) == 32 + kTile * sb &&
                    mins.sizes() == scales.sizes() && mins.scalar_type() == at::kByte && scales.is_contiguous() &&
                    mins.is_contiguous(),
                "woq_amx: two-level scales / mins do not match the shape");
    return;
  }
  TORCH_CHECK(scales.numel() == N * groups && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "woq_amx: scales must be float32 or float16 [N/16, groups, 16]");
  const bool derived = mins.numel() == 1 && mins.scalar_type() == at::kFloat && scales.scalar_type() == at::kHalf;
  TORCH_CHECK(derived || (mins.numel() == scales.numel() && mins.scalar_type() == scales.scalar_type() &&
                          mins.is_contiguous()),
              "woq_amx: mins must match the scales, or be one float32 factor beside float16 scales");
}

// x [M, K] bf16; bias float32 [N] or None. Returns bf16 [M, N].
at::Tensor gemm(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins, c10::optional<at::Tensor> bias,
                int64_t bits, int64_t group_size, int64_t out_features) {
  check_args(x, codes, scales, mins, bits, group_size, out_features);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  return woq::gemm_tensor(x, codes, scales, mins, b, bits, group_size, out_features);
}

// The same product for 1-8 rows of x with int8 (AVX512-VNNI) dot products, x rounded per 32 inputs: woq_gemv.h.
at::Tensor gemv(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins, c10::optional<at::Tensor> bias,
                int64_t bits, int64_t group_size, int64_t out_features) {
  check_args(x, codes, scales, mins, bits, group_size, out_features);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  return woq::gemv_tensor(x, codes, scales, mins, b, bits, group_size, out_features);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this CPU and kernel let the process use AMX (asks once)");
  m.def("gemm", &gemm, "x @ dequantize(codes, scales, mins)^T on AMX");
  m.def("gemv", &gemv, "the same for 1-8 rows, int8 (VNNI) dot products on the codes");
}
