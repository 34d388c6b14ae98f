// Decode paged attention and the K/V cache write (paged_decode.h), bound for Python (attention/cpu_kernel.py).
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for pybind11, without all of torch/extension.h

#include "paged_decode.h"

using namespace paged;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("write_kv", &write_kv, "store new K/V at their cache slots");
}
