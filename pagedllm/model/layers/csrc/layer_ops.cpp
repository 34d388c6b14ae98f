// The element-wise layer ops of layer_ops.h, bound for Python (model/layers/cpu_ops.py).
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for pybind11, without all of torch/extension.h

#include "layer_ops.h"

using namespace layer_ops;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mean_of_squares", &mean_of_squares, "mean(float(x)^2) per row, summed as ATen sums");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "(residual + x, RMSNorm(residual + x))");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary_", &rotary_, "rotary embedding in place");
}
