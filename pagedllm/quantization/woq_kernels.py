"""The backends of the quantized_linear op: one class a kernel, each with `supports`, `pack`, `matmul`.

A QuantLinear (linear.py) is the stored weight: codes, scales, mins, bits, group. At build time it asks
`choose(...)` for the first kernel of the op table's backend (ops.py) that takes its shape and the
activations' dtype, and keeps that kernel and the layout it packed; a call then is `kernel.matmul`. Where
no kernel takes it, or inside forced(quantized_linear="torch"), the torch reference runs
(QuantLinear.forward_native: dequantize, then F.linear).

    AmxKernel          amx tier, bf16 activations: int8 (VNNI) dot products for 1-GEMV_MAX_ROWS rows, AMX
                       tiles above, on one layout (amx.py, csrc/woq_amx.h, csrc/woq_gemv.h)
    Avx2Kernel         every tier from avx2 up, fp32 or bf16 activations quantized to int8 on the fly,
                       VPMADDUBSW dot products, any rows (avx2.py, csrc/woq_avx2.h)
    TorchPackedKernel  torch's own int4 / int8 packed kernels for small bf16 batches (no C++ of ours), the
                       weight dequantized per call above KERNEL_MAX_ROWS: CPUs below avx2, odd shapes

The AMX and AVX2 layouts hold the codes, scales and mins exactly (`holds_weight`), so the stored copy is
dropped once they are built and rebuilt from them on demand (`unpack`); both are led by row groups
(RowStackedKernel), so a fused q/k/v or a big weight built in slices joins its parts' layouts as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import torch

from pagedllm import ops
from pagedllm.quantization import amx, avx2

if TYPE_CHECKING:
    from pagedllm.quantization.gguf_blocks import SuperBlocks
    from pagedllm.quantization.linear import QuantLinear

Layout = tuple[torch.Tensor, ...]

# Rows at or below which the int8 dot-product kernel runs on the AMX layout; the AMX tiles above (their cost
# is dequantizing the weight to bf16, flat up to 16 rows). Measured on an AMX Xeon (2 threads, a 1B model's
# 8192 x 2048 Q4_K layer, weights from DRAM): gemv 0.38 / 0.62 / 1.00 / 1.22 ms at 1 / 4 / 5 / 8 rows
# (above 4, two passes over the codes, the second from L2), the tiles 1.27-1.31 ms at 1-16 rows.
GEMV_MAX_ROWS = 8
# Rows at or below which torch's packed kernels run (else: dequantize + bf16 GEMM). Measured (AVX-512 BF16,
# 1 thread, medians, default-model shapes 576x576 / 1536x576 / 576x1536): both cost ~8-20 us a row (INT8 a
# little more, plus the zero-point correction), the dequantize path ~0.45-1.4 ms plus ~1-3 us a row.
# INT4 crosses near 64 rows, INT8 near 32-64.
KERNEL_MAX_ROWS = {"int4": 64, "int8": 48}
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu accepts


class WoqKernel:
    """One quantized-linear kernel: which layers it takes, its layout of their weight, and the product."""

    name: str
    holds_weight: bool  # its layout holds codes, scales and mins exactly: the stored copy can go
    indexes_rows = False  # rows() reads only the rows asked for (else it unpacks the whole layout)
    stacks_rows = (
        False  # stack() joins layouts of row slices (each but the last a multiple of ROW_ALIGN rows)
    )
    ROW_ALIGN = 8

    def supports(self, layer: QuantLinear, dtype: torch.dtype) -> bool:
        raise NotImplementedError

    def pack(self, layer: QuantLinear) -> Layout:
        raise NotImplementedError

    def unpack(self, layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [out, in], scales, mins float32 [out, groups]) back from layer.layout."""
        raise NotImplementedError(f"the {self.name} layout does not hold the weight")

    def rows(self, layer: QuantLinear, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """unpack()'s (codes, scales, mins) of output rows `ids` only."""
        codes, scales, mins = self.unpack(layer)
        return codes[ids], scales[ids], mins[ids]

    def stackable(self, layouts: list[Layout]) -> bool:
        """Whether stack() can join these layouts (one form of scales, one input width)."""
        return False

    def stack(self, layouts: list[Layout]) -> Layout:
        """The layout of the row slices' layers, one after the other (where stacks_rows)."""
        raise NotImplementedError(f"the {self.name} layout does not stack by rows")

    def superblocks(self, layer: QuantLinear) -> SuperBlocks | None:
        """The K-quant factoring of the scales back from layer.layout, where the layout keeps it."""
        return None

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] contiguous -> [M, out] in x's dtype, the bias added."""
        raise NotImplementedError

    def dequantizes_at(self, layer: QuantLinear, rows: int) -> bool:
        """Whether a call of `rows` rows rebuilds the float weight (then a big layer costs that every call)."""
        return False


class RowStackedKernel(WoqKernel):
    """A kernel whose layout is (codes, scales, mins), each led by row groups of ROW_ALIGN output rows, the
    mins kept either in the scales' form or as one factor c (mins = c x scales): row slices join by
    concatenating them (a fused q/k/v, a big weight built slice by slice), nothing unpacked."""

    stacks_rows = True
    packer: Callable[..., Layout]  # the layout module's pack(codes, scales, mins, bits, superblocks)

    def pack(self, layer: QuantLinear) -> Layout:
        codes, (scales, mins) = layer.codes(), layer.scales_and_mins()
        return self.pack_codes(codes, scales, mins, layer.bits, layer.superblocks)

    def pack_codes(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bits: int,
        superblocks: SuperBlocks | None,
    ) -> Layout:
        """The layout of codes uint8 [out, in] with scales / mins float32 [out, groups] (what pack() reads
        from a layer; QuantLinear.packed_from_codes passes them without building the stored form)."""
        return self.packer(codes, scales, mins, bits, superblocks)

    def stackable(self, layouts: list[Layout]) -> bool:
        # derived mins (one factor c each, the same form in both layouts) join only where every part has
        # the same c
        if len({avx2.min_factor(layout) for layout in layouts}) != 1:
            return False
        return all(
            len({(t.dtype, tuple(t.shape[1:])) for t in parts}) == 1 for parts in zip(*layouts, strict=True)
        )

    def stack(self, layouts: list[Layout]) -> Layout:
        codes, scales, mins = (torch.cat(parts) for parts in zip(*layouts))  # row groups lead every tensor
        return codes, scales, layouts[0][2] if avx2.min_factor(layouts[0]) is not None else mins


class AmxKernel(RowStackedKernel):
    name, holds_weight, indexes_rows = "amx", True, True
    ROW_ALIGN = 16  # a B tile's output columns
    packer = staticmethod(amx.pack_codes)

    def __init__(self, ext):
        self.ext = ext

    def supports(self, layer: QuantLinear, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and amx.supports(
            layer.bits, layer.in_features, layer.out_features, layer.group_size
        )

    def unpack(self, layer: QuantLinear):
        codes, scales, mins = layer.layout
        return (amx.unpack_codes(codes, layer.bits), *amx.unpack_scales_mins(scales, mins))

    def superblocks(self, layer: QuantLinear):
        return amx.superblocks(layer.layout)

    def rows(self, layer: QuantLinear, ids: torch.Tensor):
        return amx.rows(layer.layout, ids, layer.bits)

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.to(x.dtype)  # rounded as F.linear's would be
        fn = self.ext.gemv if x.shape[0] <= GEMV_MAX_ROWS else self.ext.gemm
        return fn(x, *layer.layout, bias, layer.bits, layer.group, layer.out_features)


class Avx2Kernel(RowStackedKernel):
    name, holds_weight, indexes_rows = "avx2", True, True
    ROW_ALIGN = avx2.COLS  # a panel's columns
    packer = staticmethod(avx2.pack)

    def supports(self, layer: QuantLinear, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and avx2.supports(
            layer.bits, layer.in_features, layer.out_features, layer.group_size
        )

    def unpack(self, layer: QuantLinear):
        return avx2.unpack(layer.layout, layer.bits, layer.out_features, layer.in_features, layer.group_size)

    def superblocks(self, layer: QuantLinear):
        return avx2.superblocks(layer.layout, layer.out_features)

    def rows(self, layer: QuantLinear, ids: torch.Tensor):
        return avx2.rows(layer.layout, ids, layer.bits, layer.in_features, layer.group_size)

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return avx2.matmul(
            x,
            layout=layer.layout,
            bias=layer.bias,
            bits=layer.bits,
            group_size=layer.group_size,
            out_features=layer.out_features,
        )


class TorchPackedKernel(WoqKernel):
    """torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm, for bf16 activations.

    INT4, group 32/64/128/256: the kernel computes w = (q - 8) * scale + zero per group, so scale = s and
    zero = m + 8 s reproduce w = s*q + m (scales rounded to bf16: the precision of a bf16 weight).
    INT8 per channel: the kernel is symmetric (w = s * q8); with q8 = q - 128 (the stored qweight),
    x @ w^T = s * (x @ q8^T) + (sum_k x_k) * (m + 128 s), the kernel run with unit scales and the rest in
    fp32. Their time grows with rows (the weight is dequantized per row), so above KERNEL_MAX_ROWS the
    reference's one dequantization per call is cheaper."""

    name, holds_weight = "torch-packed", False

    @staticmethod
    def kind(layer: QuantLinear) -> str | None:
        if layer.bits == 4 and layer.group_size in INT4_KERNEL_GROUPS and layer.out_features % 16 == 0:
            return "int4"
        if layer.bits == 8 and layer.group_size is None:
            return "int8"
        return None

    def supports(self, layer: QuantLinear, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and self.kind(layer) is not None

    def pack(self, layer: QuantLinear) -> Layout:
        scales, mins = layer.scales_and_mins()
        if self.kind(layer) == "int4":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(layer.codes().to(torch.int32), 2)
            zero = mins + 8 * scales  # the kernel's zero is the value at code 8
            sz = torch.stack((scales, zero), dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
            return packed, sz.to(torch.bfloat16)
        ones = torch.ones(layer.out_features, dtype=torch.bfloat16)
        return ones, (mins + 128 * scales).reshape(-1)  # the correction, per channel in fp32

    def dequantizes_at(self, layer: QuantLinear, rows: int) -> bool:
        return rows > KERNEL_MAX_ROWS[self.kind(layer)]

    def matmul(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if self.dequantizes_at(layer, x.shape[0]):
            return layer.forward_native(x)
        if self.kind(layer) == "int4":
            packed, sz = layer.layout
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, layer.group_size, sz)
        else:  # qweight holds q - 128 as int8
            ones, corr = layer.layout
            y = torch.ops.aten._weight_int8pack_mm(x, layer.qweight, ones).float() * layer.scales.reshape(-1)
            y = torch.addcmul(y, x.float().sum(dim=1, keepdim=True), corr).to(x.dtype)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)


@cache
def _candidates(backend: str) -> tuple[WoqKernel, ...]:
    """The kernels of a backend in the order they are tried; torch's packed kernels last for the shapes
    and dtypes ours refuse."""
    if backend == "amx":
        return AmxKernel(ops.kernel("quantized_linear", "woq_amx")), Avx2Kernel(), TorchPackedKernel()
    if backend == "avx2":
        return Avx2Kernel(), TorchPackedKernel()
    if backend == "torch-packed":
        return (TorchPackedKernel(),)
    return ()  # the reference


def candidates() -> tuple[WoqKernel, ...]:
    """The kernels of the op table's current backend (forced included), in the order they are tried."""
    return _candidates(ops.backend("quantized_linear"))


def choose(layer: QuantLinear, dtype: torch.dtype) -> WoqKernel | None:
    """The kernel that multiplies `layer` by `dtype` activations under the op table's backend (forced
    included), or None for the reference. While a --batch-invariant model is built, only the kernels whose
    row results do not depend on the row count (ops.ROW_INVARIANT_QUANTIZED_KERNELS)."""
    kernels = candidates()
    if ops.building_batch_invariant():
        kernels = tuple(k for k in kernels if k.name in ops.ROW_INVARIANT_QUANTIZED_KERNELS)
    return next((k for k in kernels if k.supports(layer, dtype)), None)
