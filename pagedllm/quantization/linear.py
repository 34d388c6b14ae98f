"""QuantLinear: a weight-only quantized nn.Linear: the stored weight (codes + scales + mins) and the one
kernel (woq_kernels.py) picked for it at build.

Stored form (buffers, the portable truth; `state_dict` holds exactly these):
    qweight  uint8 [out, in / 2] for bits <= 4 (two codes a byte, pack.py's layout); int8 [out, in] holding
             q - 128 for bits 8 (what torch's INT8 kernel reads: one copy, not two); else uint8 [out, in]
    scales   float32 [out, groups]      groups = in / group_size (1 for per-channel)
    mins     float32 [out, groups]      w = scales * q + mins  (mins = -s * z for uniform.py's quantizer)
The affine form w = s*q + m (rather than s*(q - z)) also holds GGUF's Q4_1, whose min is not a whole
number of steps; uniform.py's integer zero point comes back as z = -m / s (model/quantized_checkpoint.py does that).

The kernel: `pack(dtype)` (fuse.py calls it once the model is final) asks woq_kernels.choose for the first
kernel of the op table's quantized_linear backend that takes this shape and activations of `dtype`, and
keeps it (`kernel`) with the layout it built (`layout`, never saved). Where that layout holds the weight
exactly (AMX, AVX2) the stored buffers are dropped and rebuilt from it on demand (codes(),
scales_and_mins()). A call of another dtype or under another backend (ops.forced) packs again for it.

`forward_native` is the torch reference every kernel is tested against: the weight dequantized (s*q + m in
float32, rounded once to x's dtype) and F.linear; it runs where no kernel takes the layer and inside
ops.forced(quantized_linear="torch"). No dequantized copy is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.errors import InputError
from pagedllm.quantization import woq_kernels
from pagedllm.quantization.gguf_blocks import SuperBlocks
from pagedllm.quantization.pack import pack_int4, unpack_int4
from pagedllm.quantization.uniform import QuantizedTensor

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)


def check_layer_shape(name: str, in_features: int, bits: int, group_size: int | None) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise InputError(
            f"layer {name or '?'}: bits {bits!r} is not supported by QuantLinear; use one of "
            f"{', '.join(map(str, SUPPORTED_BITS))}",
            param="bits",
        )
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InputError(
            f"layer {name or '?'}: group_size must be a whole number >= 1, got {group_size!r}",
            param="group_size",
        )
    if in_features % group_size:
        raise InputError(
            f"layer {name or '?'}: group_size {group_size} does not divide in_features {in_features}",
            param="group_size",
        )


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int | None,
        bias: bool = False,
        name: str = "",
    ):
        super().__init__()
        check_layer_shape(name, in_features, bits, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.name = bits, group_size, name
        groups = 1 if group_size is None else in_features // group_size
        width = (in_features + 1) // 2 if bits <= 4 else in_features
        qdtype = torch.int8 if bits == 8 else torch.uint8
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=qdtype))
        self.register_buffer("scales", torch.ones(out_features, groups))
        self.register_buffer("mins", torch.zeros(out_features, groups))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.superblocks: SuperBlocks | None = (
            None  # set by the GGUF loader for K-quants (kernels may use it)
        )
        self.kernel: woq_kernels.WoqKernel | None = None  # chosen by pack(); None: the reference
        self.layout: tuple[torch.Tensor, ...] = ()  # the kernel's copy of the weight, built by pack()
        self._packed_for: tuple[torch.dtype, str] | None = None  # (activation dtype, backend) of the layout

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bits: int,
        group_size: int | None,
        bias: torch.Tensor | None = None,
        name: str = "",
    ) -> QuantLinear:
        """codes uint8 [out, in] in 0..2^bits-1; scales/mins [out, groups]: w = scales * q + mins."""
        out_features, in_features = codes.shape
        layer = cls(in_features, out_features, bits, group_size, bias is not None, name)
        layer._check_scales(scales, mins)
        layer._store(codes, scales, mins)
        if bias is not None:
            layer.bias = bias.detach().to(torch.float32).clone()
        return layer

    @classmethod
    def packed_from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bits: int,
        group_size: int | None,
        dtype: torch.dtype,
        superblocks: SuperBlocks | None = None,
        bias: torch.Tensor | None = None,
        name: str = "",
    ) -> QuantLinear:
        """from_codes, then pack(dtype): where the kernel's layout holds the weight it is built from `codes`
        as given and the stored form never exists (a GGUF load skips a round trip through pack.py's nibbles:
        ~15% of a first load)."""
        out_features, in_features = codes.shape
        with torch.device("meta"):  # only to ask which kernel takes this shape
            probe = cls(in_features, out_features, bits, group_size, name=name)
        probe._check_scales(scales, mins)
        kernel = woq_kernels.choose(probe, dtype)
        if kernel is None or not kernel.holds_weight:
            layer = cls.from_codes(codes, scales, mins, bits, group_size, bias, name)
            layer.superblocks = superblocks
            layer.pack(dtype)
            return layer
        layout = kernel.pack_codes(codes.to(torch.uint8), scales.float(), mins.float(), bits, superblocks)
        packed_for = (dtype, ops.backend("quantized_linear"))
        return cls.from_layout(
            kernel, layout, in_features, out_features, bits, group_size, packed_for, bias, name
        )

    def _check_scales(self, scales: torch.Tensor, mins: torch.Tensor) -> None:
        groups = self.scales.shape[1]
        if tuple(scales.shape) != (self.out_features, groups) or tuple(mins.shape) != (
            self.out_features,
            groups,
        ):
            raise InputError(
                f"layer {self.name or '?'}: scales {tuple(scales.shape)} / mins {tuple(mins.shape)} must be "
                f"[{self.out_features}, {groups}] for group_size {self.group_size}",
                param="scales",
            )

    @classmethod
    def from_quantized(
        cls, qt: QuantizedTensor, bias: torch.Tensor | None = None, name: str = ""
    ) -> QuantLinear:
        """From uniform.py's output for a [out, in] weight: per channel (axis 0) or group-wise along in."""
        if qt.codes.dim() != 2:
            raise InputError(f"layer {name or '?'}: expected a 2-D weight, got {qt.codes.dim()}-D", "qt")
        out_features, in_features = qt.codes.shape
        if qt.group_size is None and qt.axis == 0:
            group_size = None
        elif qt.group_size is not None and qt.axis == 1:
            group_size = qt.group_size
        else:
            raise InputError(
                f"layer {name or '?'}: needs per-channel (axis=0) or group-wise along the input (axis=1) "
                f"codes, got axis={qt.axis}, group_size={qt.group_size}",
                param="qt",
            )
        scale = qt.scale.reshape(out_features, -1).to(torch.float64)
        z = qt.zero_point.reshape(out_features, -1).to(torch.float64)
        # m = -s*z rounded once (float64 holds s*z exactly); quantized_checkpoint.py recovers z = round(-m / s).
        return cls.from_codes(qt.codes, scale.float(), (-scale * z).float(), qt.bits, group_size, bias, name)

    @classmethod
    def concat(cls, layers: list[QuantLinear], name: str = "") -> QuantLinear:
        """One layer computing every input layer's outputs side by side (e.g. q, k and v in one call): the
        stored rows are stacked, so the result is exactly the parts' results concatenated."""
        first = layers[0]
        for other in layers[1:]:
            if (other.in_features, other.bits, other.group_size) != (
                first.in_features,
                first.bits,
                first.group_size,
            ):
                raise ValueError(f"cannot concatenate {first.extra_repr()} with {other.extra_repr()}")
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers])
        if cls.stacks(layers):  # the kernel layouts joined as they are: nothing unpacked or packed again
            return cls.stack_packed(layers, bias, name)
        parts = [m.scales_and_mins() for m in layers]
        superblocks = SuperBlocks.cat([m.superblocks_now() for m in layers])
        layer = cls.from_codes(
            torch.cat([m.codes() for m in layers]),
            torch.cat([sm[0] for sm in parts]),
            torch.cat([sm[1] for sm in parts]),
            first.bits,
            first.group_size,
            bias,
            name,
        )
        layer.superblocks = superblocks
        return layer

    @staticmethod
    def stacks(parts: list[QuantLinear]) -> bool:
        """Whether stack_packed can join these layers: one kernel's stackable layouts, packed alike."""
        kernel = parts[0].kernel
        return (
            kernel is not None
            and kernel.stacks_rows
            and all(p.kernel is kernel and p._packed_for == parts[0]._packed_for for p in parts)
            and all(p._stored_released() for p in parts)
            and all(p.out_features % kernel.ROW_ALIGN == 0 for p in parts[:-1])
            and kernel.stackable([p.layout for p in parts])
        )

    @classmethod
    def stack_packed(
        cls, parts: list[QuantLinear], bias: torch.Tensor | None = None, name: str = ""
    ) -> QuantLinear:
        """One layer from row slices packed by one kernel whose layout stacks (kernel.stacks_rows): a big
        weight built slice by slice, so no full-size transient of it ever exists."""
        first = parts[0]
        kernel = first.kernel
        if not cls.stacks(parts):
            raise ValueError(
                "stack_packed: the parts must be packed alike by one kernel whose layouts stack, every part "
                "but the last a whole number of its row groups"
            )
        return cls.from_layout(
            kernel,
            kernel.stack([p.layout for p in parts]),
            first.in_features,
            sum(p.out_features for p in parts),
            first.bits,
            first.group_size,
            first._packed_for,
            bias,
            name,
        )

    @classmethod
    def from_layout(
        cls,
        kernel: woq_kernels.WoqKernel,
        layout: tuple[torch.Tensor, ...],
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int | None,
        packed_for: tuple[torch.dtype, str],
        bias: torch.Tensor | None = None,
        name: str = "",
    ) -> QuantLinear:
        """A layer whose only copy of the weight is `kernel`'s layout (a kernel that holds_weight), built
        for packed_for's (activation dtype, op-table backend)."""
        with torch.device("meta"):  # no stored buffers: the layout is the weight
            layer = cls(in_features, out_features, bits, group_size)
        layer.name, layer.kernel, layer.layout, layer._packed_for = name, kernel, layout, packed_for
        layer.qweight = layer.scales = layer.mins = layer.bias = None
        if bias is not None:
            layer.bias = bias.detach().to(torch.float32).clone()
        return layer

    # ---- what is stored ---------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.scales_and_mins()[0].shape[1]

    @property
    def group(self) -> int:
        """The group size the kernels take: the whole input row for per-channel scales."""
        return self.group_size or self.in_features

    def _stored_released(self) -> bool:
        return self.qweight is None

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [out, groups] each, from the stored buffers or, once released, the kernel's layout."""
        if self._stored_released():
            return self.kernel.unpack(self)[1:]
        return self.scales, self.mins

    def superblocks_now(self) -> SuperBlocks | None:
        """The K-quant factoring of the scales, from the loader or, once released, the kernel's layout."""
        if self._stored_released():
            return self.kernel.superblocks(self)
        return self.superblocks

    def codes(self) -> torch.Tensor:
        """The codes as uint8 [out, in]."""
        if self._stored_released():
            return self.kernel.unpack(self)[0]
        if self.bits <= 4:
            return unpack_int4(self.qweight, self.in_features)
        if self.bits == 8:
            return (self.qweight.to(torch.int16) + 128).to(torch.uint8)
        return self.qweight

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight, float32 [n, in]: dequantize_weight()[ids] bit for bit,
        computing only those rows (QuantEmbedding's lookup)."""
        ids = ids.reshape(-1).long()
        if self._stored_released():
            codes, scales, mins = self.kernel.rows(self, ids)
        else:
            q = self.qweight[ids]
            if self.bits <= 4:
                codes = unpack_int4(q, self.in_features)
            else:
                codes = (q.to(torch.int16) + 128).to(torch.uint8) if self.bits == 8 else q
            scales, mins = self.scales[ids], self.mins[ids]
        w = (
            codes.view(len(ids), scales.shape[1], -1)
            .float()
            .mul_(scales.unsqueeze(-1))
            .add_(mins.unsqueeze(-1))
        )
        return w.reshape(len(ids), self.in_features)

    def gives_rows_cheaply(self) -> bool:
        """Whether rows() costs the rows only (the stored form, or a kernel layout that indexes by row)."""
        return not self._stored_released() or self.kernel.indexes_rows

    def stored_copy(self) -> QuantLinear:
        """A copy in the stored form only (no kernel layout), e.g. for row lookups beside an AMX layout."""
        return QuantLinear.from_codes(
            self.codes(), *self.scales_and_mins(), self.bits, self.group_size, self.bias, self.name
        )

    def portable_qweight(self) -> torch.Tensor:
        """The codes as model/quantized_checkpoint.py stores them: pack.py's nibbles for bits <= 4, else uint8 [out, in]."""
        if self.bits <= 4:
            return self.qweight if self.qweight is not None else pack_int4(self.codes())
        return self.codes()

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w = s*q + m computed in float32, then rounded once to `dtype` (bit-exact in float32 for GGUF's
        fp16 scales). Computing in bf16 would be ~2.5x faster but rounds q*s and the sum separately, and
        m can be much larger than w: measured 2-3x the error of a bf16 weight, so it is not done."""
        scales, mins = self.scales_and_mins()
        q = self.codes().view(self.out_features, self.groups, -1).float()
        w = q.mul_(scales.unsqueeze(-1)).add_(mins.unsqueeze(-1))
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def weight_bytes(self) -> int:
        """Resident bytes: the stored buffers plus the kernel's layout."""
        tensors = [self.qweight, self.scales, self.mins, self.bias, *self.layout]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ---- the kernel ------------------------------------------------------------------------------------
    def pack(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Choose the kernel for activations of `dtype` under the op table's backend and build its layout
        (idempotent); where the layout holds the weight exactly, the stored form is dropped."""
        backend = ops.backend("quantized_linear")
        if self._packed_for == (dtype, backend):
            return
        kernel = woq_kernels.choose(self, dtype)
        if self._stored_released():  # the current layout is the only copy: restore the stored form first
            codes, (scales, mins), superblocks = self.codes(), self.scales_and_mins(), self.superblocks_now()
            self._store(codes, scales, mins)
            self.superblocks = superblocks
        self.kernel, self.layout = kernel, ()
        if kernel is not None:
            self.layout = kernel.pack(self)
            if kernel.holds_weight:
                self.qweight = self.scales = self.mins = self.superblocks = None
        self._packed_for = (dtype, backend)

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        codes = codes.to(torch.uint8)
        if self.bits <= 4:
            self.qweight = pack_int4(codes)
        elif self.bits == 8:
            self.qweight = (codes.to(torch.int16) - 128).to(torch.int8)
        else:
            self.qweight = codes.contiguous()
        self.scales = scales.to(torch.float32).contiguous()
        self.mins = mins.to(torch.float32).contiguous()

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference: the weight dequantized (s*q + m in float32, rounded once to x's dtype) and
        F.linear. Every kernel is tested against it."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize_weight(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        self.pack(x.dtype)  # a no-op once built for this dtype and backend
        if self.kernel is None:
            y = self.forward_native(x2)
        else:
            y = self.kernel.matmul(self, x2.contiguous())
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, {g}, "
            f"kernel={self.kernel.name if self.kernel else None}"
        )
