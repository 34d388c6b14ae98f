"""A bf16 linear whose weight is laid out once, at engine start, for the kernel that multiplies it.

oneDNN's own blocked layout by default (`F.linear` on a plain bf16 weight reorders it on every call,
which for these small matrices costs as much as the multiply: the 30 layers of the default model at 32
rows 36 -> 31 ms prepacked, at 256 rows 105 -> 66 ms). Its results are `F.linear`'s bit for bit, and the
engine's bf16 greedy tokens are held to that: tests/test_bf16_vs_fp32.py and the int8-KV engine test
were measured on these bits and fail on any other summation order.

The AMX tile order ([N/16, K/2, 32], `amx.pack_bf16`; layout="amx"): the weight multiplied by the
quantized layers' kernels with nothing to dequantize, AVX512-BF16 dot products for 1-4 rows and AMX
tiles above. Per call, 30 weights of each of the default model's shapes alternated with oneDNN's
(scripts/bench_linears.py): 1.1-3.3x faster at 1-50 rows, 1-1.8x at 256, 0.8-0.9x at 2,048, since a
decode step's bf16 linears are bound by reading the weights and these read them at 15-26 GB/s where
oneDNN's read at 10-13. But its products are summed in float32 in another order than oneDNN's (~0.1% of
outputs one ulp apart), which moves greedy tokens at close calls: the two tests above failed with it. So
it is used only where oneDNN's prepacking is missing, and by the benchmark.

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
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # "onednn": oneDNN's blocked layout (the default where it exists); "amx": the tile order of
        # quantization/amx.py's kernels
        if layout is None:
            layout = "onednn" if prepacking_available() or not tile_order_fits(weight) else "amx"
        if layout not in ("onednn", "amx") or (layout == "amx" and not tile_order_fits(weight)):
            raise ValueError(
                f"PackedLinear: layout {layout!r} does not take a {weight.dtype} {tuple(weight.shape)} weight"
            )
        self.layout = layout
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
