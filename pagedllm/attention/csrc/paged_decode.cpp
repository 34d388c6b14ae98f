// Decode paged attention and the K/V cache write (paged_decode.h), bound for Python (attention/cpu_kernel.py).
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for pybind11, without all of torch/extension.h

#include "paged_decode.h"

using namespace paged;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", pybind11::arg("q"), pybind11::arg("kv_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0);
  m.def("write_kv", &write_kv, "store new K/V at their cache slots");
}
