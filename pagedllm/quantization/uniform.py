"""Asymmetric uniform quantization of torch tensors, exactly as the spec writes it.

    s = (r_max - r_min) / (2^b - 1)
    z = round(-r_min / s)
    q = clip(round(r / s) + z, 0, 2^b - 1)
    r_hat = s * (q - z)

round() is round-half-up, floor(x + 0.5), not Python's or torch's round-half-even. The range is the
data's own [min, max] of each group unless a calibration range (rmin, rmax) is passed; values beyond it
saturate at the end codes.

Granularity (one (s, z) pair per group):
  per-tensor   axis=None, group_size=None        scale shape ()
  per-channel  axis=a,    group_size=None        one pair per index along axis a; scale shape [size of a]
  group-wise   axis=a,    group_size=g           axis a is cut into runs of g contiguous elements, one
               (axis defaults to -1)              pair per run: scale shape = x.movedim(a, -1).shape[:-1]
                                                 + [size of a / g]. A [out, in] weight with axis=-1 and
                                                 g=in is the same as per-channel with axis=0.

Constant groups (r_max == r_min == v, including all zeros) would divide by zero. A tiny epsilon floor for
s does not help (0.3 would come back as ~0.00366), so they get a grid on purpose, chosen so that the
single value sits on a code and comes back bit-exactly:
  v > 0: s = v,  z = 0, q = 1  ->  r_hat = v * (1 - 0) = v
  v < 0: s = -v, z = 1, q = 0  ->  r_hat = -v * (0 - 1) = v
  v = 0: s = 1,  z = 0, q = 0  ->  r_hat = 0
v / |v| is exactly +-1 in floating point, so q is exact too. A range so narrow that s underflows to 0
is treated the same way (v = r_max).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.errors import InputError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8, 16)


@dataclass
class QuantizedTensor:
    codes: torch.Tensor  # the input's shape; uint8 for bits <= 8, int32 for 16
    scale: torch.Tensor  # s, one per group (shapes in the module docstring); float32 (float64 input: float64)
    zero_point: torch.Tensor  # z, int64, scale's shape; may lie outside [0, 2^b-1] if 0 is not in the range
    bits: int
    axis: int | None  # None: per-tensor; else normalized to >= 0
    group_size: int | None  # None: per-tensor or per-channel


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise InputError(
            f"bits {bits!r} is not supported; use one of {', '.join(map(str, SUPPORTED_BITS))}",
            param="bits",
        )
    return bits


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """Ties go to the larger integer: 2.5 -> 3, -2.5 -> -2 (torch.round would give 2 and -2)."""
    return torch.floor(x + 0.5)


def qparams(rmin: torch.Tensor, rmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, z) for each range, as floats; constant ranges get the exact grid described above."""
    levels = 2 ** check_bits(bits) - 1
    s = (rmax - rmin) / levels
    const = s <= 0  # r_max == r_min, or a range whose step underflows to 0
    z = round_half_up(-rmin / torch.where(const, torch.ones_like(s), s))
    v = rmax
    s_const = torch.where(v != 0, v.abs(), torch.ones_like(v))
    z_const = (v < 0).to(s.dtype)
    return torch.where(const, s_const, s), torch.where(const, z_const, z)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _normalize_axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -max(ndim, 1) <= axis < max(ndim, 1):
        raise InputError(f"axis {axis!r} is out of range for a tensor with {ndim} dims", param="axis")
    return axis % max(ndim, 1)


def _to_rows(x: torch.Tensor, axis: int | None, group_size: int | None):
    """View x as [groups, elements of one group] and return (rows, scale shape)."""
    if axis is None:
        return x.reshape(1, -1), ()
    if group_size is None:
        xm = x.movedim(axis, 0) if x.dim() else x.reshape(1)
        return xm.reshape(xm.shape[0], -1), (xm.shape[0],)
    xm = x.movedim(axis, -1) if x.dim() else x.reshape(1)
    n = xm.shape[-1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InputError(f"group_size must be a whole number >= 1, got {group_size!r}", param="group_size")
    if n % group_size:
        raise InputError(
            f"group_size {group_size} does not divide axis {axis} of size {n}; pick a divisor of {n}",
            param="group_size",
        )
    return xm.reshape(-1, group_size), (*xm.shape[:-1], n // group_size)


def _from_rows(rows: torch.Tensor, shape: torch.Size, axis: int | None, group_size: int | None):
    if axis is None or len(shape) == 0:
        return rows.reshape(shape)
    if group_size is None:
        moved = (shape[axis], *shape[:axis], *shape[axis + 1 :])
        return rows.reshape(moved).movedim(0, axis)
    moved = (*shape[:axis], *shape[axis + 1 :], shape[axis])
    return rows.reshape(moved).movedim(-1, axis)


def _range_arg(value, name: str, stat_shape, dtype) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype)
    if not torch.isfinite(t).all():
        raise InputError(f"{name} must be a finite number", param=name)
    try:
        return t.expand(stat_shape).reshape(-1, 1)
    except RuntimeError as e:
        raise InputError(
            f"{name} of shape {tuple(t.shape)} does not fit scale shape {stat_shape}", name
        ) from e


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    axis: int | None = None,
    group_size: int | None = None,
    rmin: float | torch.Tensor | None = None,
    rmax: float | torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize x to `bits`-bit codes; rmin/rmax (scalars or scale-shaped) override the data's range."""
    check_bits(bits)
    x = torch.as_tensor(x)
    if x.numel() == 0:
        raise InputError("cannot quantize an empty tensor", param="x")
    work = _work_dtype(x)
    xf = x.to(work)
    if not torch.isfinite(xf).all():
        raise InputError("tensor contains NaN or inf; quantization needs finite values", param="x")
    if group_size is not None and axis is None:
        axis = -1
    if axis is not None:
        axis = _normalize_axis(axis, x.dim())
    rows, stat_shape = _to_rows(xf, axis, group_size)
    lo = rows.amin(dim=1, keepdim=True) if rmin is None else _range_arg(rmin, "rmin", stat_shape, work)
    hi = rows.amax(dim=1, keepdim=True) if rmax is None else _range_arg(rmax, "rmax", stat_shape, work)
    if (lo > hi).any():
        raise InputError("rmin must be <= rmax", param="rmin")
    s, z = qparams(lo, hi, bits)
    levels = 2**bits - 1
    q = torch.clamp(round_half_up(rows / s) + z, 0, levels)
    codes = _from_rows(q.to(torch.uint8 if bits <= 8 else torch.int32), x.shape, axis, group_size)
    return QuantizedTensor(
        codes=codes,
        scale=s.reshape(stat_shape),
        zero_point=z.to(torch.int64).reshape(stat_shape),
        bits=bits,
        axis=axis,
        group_size=group_size,
    )


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """r_hat = s * (q - z), in the scale's dtype, with the codes' shape."""
    rows, _ = _to_rows(qt.codes, qt.axis, qt.group_size)
    s = qt.scale.reshape(-1, 1)
    z = qt.zero_point.reshape(-1, 1).to(s.dtype)
    r_hat = s * (rows.to(s.dtype) - z)
    return _from_rows(r_hat, qt.codes.shape, qt.axis, qt.group_size)


def fake_quantize(x: torch.Tensor, bits: int = 8, axis: int | None = None, group_size: int | None = None):
    """dequantize(quantize(x)): what a layer sees after quantization, in float."""
    return dequantize(quantize(x, bits, axis, group_size))
