"""A bf16 linear whose weight oneDNN reordered once, at engine start, into its own blocked layout.

`F.linear` on bf16 CPU tensors hands oneDNN a plain [out, in] weight, which its AMX / AVX-512 BF16
kernels reorder on every call. For this engine's small matrices (576 x 576 ... 3072 x 576) and decode
batches of 1-64 rows that reorder costs as much as the multiply: a prepacked weight measured 1.2-2x
faster per call (the 30 layers of the default model at 32 rows: 36 -> 31 ms; at 256 rows 105 -> 66 ms).
The results are the same oneDNN kernel's, bit for bit in the tests.

A faster layout was tried and taken out (docs/performance.md, fifth and sixth rounds): the weight in the
AMX tile order on the quantized layers' kernels, 1.1-3.3x per call at 1-50 rows, but summing in another
order than oneDNN's, which moved greedy tokens at close calls and failed tests/test_bf16_vs_fp32.py and
the int8-KV engine test as they were written.

The packed tensor is opaque (an MKL-DNN tensor), so it is kept as a plain attribute, not a parameter:
state_dict, quantizers and checkpoints never see it. Only the engine's inference path builds these.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.ops import prepacking_available  # noqa: F401  (re-exported: fuse.py, tests)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()
        self._nbytes = weight.numel() * weight.element_size()

    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self._nbytes + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self.packed_weight, self.bias, "none", [], ""
        )
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked bf16"
