"""A bf16 linear whose weight is laid out once, at engine start, for the kernel that multiplies it.

With AMX (quantization/amx.py): the weight in the AMX tile order ([N/16, K/2, 32], `amx.pack_bf16`),
multiplied by the same kernels as the quantized layers, with nothing to dequantize: AVX512-BF16 dot
products for 1-4 rows, AMX tiles above. A decode step's bf16 linears are bound by reading the weights,
and oneDNN's prepacked kernel read them at 10-13 GB/s where these read at 15-26: per call, 30 weights of
each of the default model's shapes alternated with oneDNN's (scripts/bench_linears.py), 1.1-3.3x faster
at 1-50 rows, 1-1.8x at 256, but 0.8-0.9x at 2,048 (a long prefill chunk: oneDNN blocks large GEMMs
better). Products are exact and summed in float32 in another order than oneDNN's.

Without AMX: oneDNN's own blocked layout (`F.linear` on a plain bf16 weight reorders it on every call,
which for these small matrices costs as much as the multiply: the 30 layers of the default model at 32
rows 36 -> 31 ms prepacked, at 256 rows 105 -> 66 ms).

Either packed tensor is kept as a plain attribute, not a parameter: state_dict, quantizers and
checkpoints never see it. Only the engine's inference path builds these.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from pagedllm.quantization import amx


@cache
def prepacking_available() -> bool:
    """oneDNN with the prepacked-linear ops (x86 builds of torch); probed once with a tiny matrix."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 16, dtype=torch.bfloat16), packed, None, "none", [], ""
        )
        return bool((y == 16).all())
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # "amx": tile order for quantization/amx.py's kernels; "onednn": oneDNN's blocked layout
        self.layout = "amx" if tile_order_fits(weight) else "onednn"
        if self.layout == "amx":
            self.packed_weight = amx.pack_bf16(weight.detach())
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()
        self._nbytes = weight.numel() * weight.element_size()

    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self._nbytes + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.layout == "amx":
            y = amx.load().linear_bf16(x2.contiguous(), self.packed_weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"prepacked bf16 ({self.layout})"
        )


def tile_order_fits(weight: torch.Tensor) -> bool:
    """Whether the AMX kernels take this weight: bf16 on a CPU with AMX, N a multiple of 16, K of 32."""
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and n % 16 == 0
        and k % 32 == 0
        and amx.load() is not None
    )
