// The `lora` op's C++ backend (lora.h), bound for Python (lora/punica.py).
#include <torch/csrc/utils/pybind.h>

#include "lora.h"

namespace {

// returns y (added to in place) so the Python side reads like the reference's `y + delta`
at::Tensor add_lora(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                    const at::Tensor& row_slots, int64_t rank, const std::vector<int64_t>& widths) {
  lora::add_lora_(y, x, a, b_t, row_slots, rank, widths);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "y += each row's adapter product (its slot's A then each slice's block of B), in place");
}
