"""QuantLinear: a weight-only quantized nn.Linear (codes + scales + zero points), served on the CPU's kernels.

Stored form (buffers, the portable truth; `state_dict` holds exactly these):
    qweight  uint8 [out, in / 2] for bits <= 4 (two codes a byte, pack.py's layout); int8 [out, in] holding
             q - 128 for bits 8 (what the INT8 kernel reads: one copy, not two); else uint8 [out, in]
    scales   float32 [out, groups]      groups = in / group_size (1 for per-channel)
    mins     float32 [out, groups]      w = scales * q + mins  (mins = -s * z for uniform.py's quantizer)
The affine form w = s*q + m (rather than s*(q - z)) also holds GGUF's Q4_1, whose min is not a whole
number of steps; uniform.py's integer zero point comes back as z = -m / s (model/quantized_checkpoint.py does that).

Kernel layouts (plain attributes, built by `pack(dtype)` for the activations' dtype; never saved):
  INT4, group 32/64/128/256: `_weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)` computes
      w = (q - 8) * scale + zero   per group,   so scale = s and zero = m + 8 s   reproduce w = s*q + m.
  INT8 per channel: `_weight_int8pack_mm(x, q8, s)` is symmetric (w = s * q8, q8 int8). With q8 = q - 128:
      x @ w^T = s * (x @ q8^T) + (sum_k x_k) * (m + 128 s)
  The kernel runs with unit scales (x @ q8^T, rounded to bf16 once) and s and the correction are applied
  in fp32, so the only rounding besides the output's is that of x @ q8^T.
The INT4 kernel takes its scales in the activation dtype, so s and zero are rounded to bf16 there: it
reproduces s*q + m to bf16 precision (the same precision as a bf16 weight), not bit for bit.

  AMX (amx.py, csrc/woq_amx.h), 4- and 8-bit codes with any group size that is a multiple of 32 (so
      GGUF Q8_0 too): its own copy of the codes in the AMX tile order, scales and mins in float32 (float16
      where that holds them exactly: GGUF's blocks). The same layout feeds two kernels: AMX tiles for
      batches, AVX512-BF16 dot products for 1-4 rows ("gemv", csrc/woq_gemv.h).

  AVX2 (avx2.py, csrc/woq_avx2.h), 4- and 8-bit codes, any group that is a multiple of 32: codes in panels
      of 8 output columns, activations (fp32 or bf16) quantized to int8 per 32 inputs on the fly, VPMADDUBSW
      dot products. Its error is that of rounding x to int8 (relative ~5e-3 on a layer's output, bound
      1.5e-2 in tests/test_woq_avx2.py), not bit-exact with the reference.

`forward_native` is the torch reference every kernel is tested against: dequantize, then F.linear.
When each path runs (`path()`, within the op table's quantized_linear backend, ops.py): on every tier
from avx2 up the AVX2 kernel takes fp32 and bf16 activations of the shapes it supports, except bf16 at the
amx tier, where the AMX kernels below run. Below avx2 (or with the backend forced to "torch"), torch's packed kernels dequantize the weight again for every row (their
time grows linearly with rows), while a bf16 GEMM or the AMX kernel dequantizes or reads the weight once
per call. With AMX (CPUs that have it), every 4- and 8-bit layer it can tile runs the gemv kernel up to
amx.GEMV_MAX_ROWS rows and AMX tiles above, and torch's kernels are not built at all. Without it, torch's
kernels run up to KERNEL_MAX_ROWS rows; above it, and for fp32/fp16 activations, other bit widths, INT8
group-wise (GGUF Q8_0) and shapes the kernels refuse, the weight is dequantized for that call (float32
math, one rounding to the activation dtype) and multiplied with F.linear. No dequantized copy is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.errors import InputError
from pagedllm.quantization import amx, avx2
from pagedllm.quantization.pack import pack_int4, unpack_int4
from pagedllm.quantization.uniform import QuantizedTensor

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu accepts
# Rows at or below which each packed kernel runs (else: dequantize + bf16 GEMM). Measured on this machine
# (AVX-512 BF16/AMX, 1 thread, medians, default-model shapes 576x576 / 1536x576 / 576x1536): both kernels
# cost ~8-20 us a row (the INT8 one a little more, plus the zero-point correction), the dequantize path
# ~0.45-1.4 ms plus ~1-3 us a row. INT4 crosses near 64 rows, INT8 near 32-64.
KERNEL_MAX_ROWS = {"int4": 64, "int8": 48}
# With AMX present, torch's kernels are not used: at 1-4 rows the gemv kernel on the AMX layout beat torch's
# INT4 kernel (2 threads, hot, default-model shapes: 15-44 us against 25-60 us at one row; equal at four)
# and needs no second copy of the codes; above 4 rows the AMX tiles win (1 row torch INT4 21-57 us vs AMX
# 48-133 us; 32 rows 244-712 vs 53-161 us).


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
        self._kernel: str | None = None  # "int4" / "int8" once pack() built a layout
        self._packed: tuple[torch.Tensor, ...] = ()
        self._amx: tuple[torch.Tensor, ...] = ()  # the AMX kernel's codes, scales, mins once built
        self._avx2: tuple[torch.Tensor, ...] = ()  # the AVX2 kernel's layout once built

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
        groups = layer.scales.shape[1]
        if tuple(scales.shape) != (out_features, groups) or tuple(mins.shape) != (out_features, groups):
            raise InputError(
                f"layer {name or '?'}: scales {tuple(scales.shape)} / mins {tuple(mins.shape)} must be "
                f"[{out_features}, {groups}] for group_size {group_size}",
                param="scales",
            )
        codes = codes.to(torch.uint8)
        if bits <= 4:
            layer.qweight = pack_int4(codes)
        elif bits == 8:
            layer.qweight = (codes.to(torch.int16) - 128).to(torch.int8)
        else:
            layer.qweight = codes.contiguous()
        layer.scales = scales.to(torch.float32).contiguous()
        layer.mins = mins.to(torch.float32).contiguous()
        if bias is not None:
            layer.bias = bias.detach().to(torch.float32).clone()
        return layer

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
        parts = [m.scales_and_mins() for m in layers]
        return cls.from_codes(
            torch.cat([m.codes() for m in layers]),
            torch.cat([sm[0] for sm in parts]),
            torch.cat([sm[1] for sm in parts]),
            first.bits,
            first.group_size,
            bias,
            name,
        )

    # ---- what is stored ---------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.scales_and_mins()[0].shape[1]

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [out, groups] each, from the stored buffers or, once released, the AMX layout."""
        if self.scales is None:
            if self._avx2:
                return self._unpack_avx2()[1:]
            return amx.unpack_groups(self._amx[1]), amx.unpack_groups(self._amx[2])
        return self.scales, self.mins

    def _unpack_avx2(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return avx2.unpack(self._avx2, self.bits, self.out_features, self.in_features, self._group())

    def _group(self) -> int:
        return self.group_size or self.in_features

    def codes(self) -> torch.Tensor:
        """The codes as uint8 [out, in]."""
        if self.qweight is None:
            if self._avx2:
                return self._unpack_avx2()[0]
            return amx.unpack_codes(self._amx[0], self.bits)
        if self.bits <= 4:
            return unpack_int4(self.qweight, self.in_features)
        if self.bits == 8:
            return (self.qweight.to(torch.int16) + 128).to(torch.uint8)
        return self.qweight

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
        """Resident bytes: the stored buffers plus the kernel layout when packed."""
        tensors = [self.qweight, self.scales, self.mins, *self._packed, *self._amx, *self._avx2]
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _release_portable(self) -> None:
        """Drop the stored codes, scales and mins where a kernel layout (AMX or AVX2) holds the same values
        in another order (no torch kernel is built beside it): 0.75 bytes a weight for INT4, 1 for INT8.
        codes(), scales_and_mins(), dequantize_weight() and quantized_checkpoint.py rebuild them from that layout."""
        if (self._amx or self._avx2) and self._kernel != "int8" and self.qweight is not None:
            self.qweight = self.scales = self.mins = None

    # ---- kernels ---------------------------------------------------------------------------------------
    def kernel_kind(self) -> str | None:
        """Which packed kernel this layer's shape allows (None: dequantize path only)."""
        if self.bits == 4 and self.group_size in INT4_KERNEL_GROUPS and self.out_features % 16 == 0:
            return "int4"
        if self.bits == 8 and self.group_size is None:
            return "int8"
        return None

    def torch_kernel(self) -> str | None:
        """The torch packed kernel this layer runs for small batches: kernel_kind(), unless it runs on the
        AMX or AVX2 layout (their kernels take every batch, and the codes are then held once)."""
        return None if self.on_amx_layout() or self.avx2_usable() else self.kernel_kind()

    def on_amx_layout(self) -> bool:
        """Whether bf16 activations go through the AMX layout's kernels (built already, or buildable)."""
        return self.amx_usable()

    def amx_usable(self) -> bool:
        """Whether the AMX kernel takes this layer (its shape, and a CPU and compiler that have it)."""
        return ops.backend("quantized_linear") == "amx" and amx.supports(
            self.bits, self.in_features, self.out_features, self.group_size
        )

    def avx2_usable(self) -> bool:
        """Whether the AVX2 kernel takes this layer (its shape, a CPU tier and compiler that have it)."""
        return (
            ops.backend("quantized_linear") in ("amx", "avx2")
            and avx2.supports(self.bits, self.in_features, self.out_features, self.group_size)
            and avx2.load() is not None
        )

    def pack(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Build the kernel layout for activations of `dtype` from the stored form (idempotent); where
        the layout repeats the stored form, the stored form is released (_release_portable)."""
        path = self.path(32, dtype)
        if path in ("gemv", "amx") and not self._amx:
            codes, (scales, mins) = self.codes(), self.scales_and_mins()
            self._amx = amx.pack_codes(codes, scales, mins, self.bits)
        elif path == "avx2" and not self._avx2:
            codes, (scales, mins) = self.codes(), self.scales_and_mins()
            self._avx2 = avx2.pack(codes, scales, mins, self.bits)
        kind = self.torch_kernel()
        if kind is not None and self._kernel is None and dtype == torch.bfloat16:
            self._pack_torch_kernel(kind)
        self._release_portable()

    def _pack_torch_kernel(self, kind: str) -> None:
        if kind == "int4":
            q = self.codes().to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            zero = self.mins + 8 * self.scales  # the kernel's zero is the value at code 8
            sz = torch.stack((self.scales, zero), dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
            self._packed = (packed, sz.to(torch.bfloat16))
        else:  # qweight already holds q - 128 as int8
            ones = torch.ones(self.out_features, dtype=torch.bfloat16)
            corr = (self.mins + 128 * self.scales).reshape(-1)  # per channel, kept in fp32
            self._packed = (ones, corr)
        self._kernel = kind

    def _kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel == "int4":
            packed, sz = self._packed
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, self.group_size, sz)
        ones, corr = self._packed
        y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, ones).float() * self.scales.reshape(-1)
        return torch.addcmul(y, x.float().sum(dim=1, keepdim=True), corr).to(x.dtype)

    def path(self, rows: int, dtype: torch.dtype) -> str:
        """Which implementation multiplies `rows` rows of `dtype`: "gemv", "amx" (the AMX tier's kernels,
        bf16), "avx2" (every tier from avx2 up, fp32 or bf16), "int4", "int8" (torch's, bf16) or
        "dequantize"; the backend comes from the op table (ops.py), the shape decides within it."""
        if dtype == torch.bfloat16 and self.on_amx_layout():
            return "gemv" if rows <= amx.GEMV_MAX_ROWS else "amx"
        if dtype in (torch.float32, torch.bfloat16) and self.avx2_usable():
            return "avx2"
        if dtype != torch.bfloat16:
            return "dequantize"
        kind = self.kernel_kind()
        if kind is not None and rows <= KERNEL_MAX_ROWS[kind]:
            return kind
        return "dequantize"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference: the weight dequantized (s*q + m in float32, rounded once to x's dtype) and
        F.linear. Every kernel path is tested against it."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize_weight(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        path = self.path(x2.shape[0], x.dtype)
        if path == "dequantize":
            y = self.forward_native(x2)
        elif path == "avx2":
            if not self._avx2:
                self.pack(x.dtype)
            y = avx2.matmul(x2.contiguous(), self._avx2, self.bias, self.bits, self._group(), self.out_features)
        else:
            amx_path = path in ("gemv", "amx")
            if not (self._amx if amx_path else self._kernel):  # the layout this path reads
                self.pack()
            if amx_path:
                bias = None if self.bias is None else self.bias.to(x.dtype)  # rounded as F.linear's would be
                kernel = amx.load().gemv if path == "gemv" else amx.load().gemm
                y = kernel(
                    x2.contiguous(),
                    *self._amx,
                    bias,
                    self.bits,
                    self.group_size or self.in_features,
                    self.out_features,
                )
            else:
                y = self._kernel_mm(x2.contiguous())
                if self.bias is not None:
                    y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, {g}, "
            f"kernel={self.kernel_kind()}"
        )
