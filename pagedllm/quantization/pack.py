"""INT4 packing: two 4-bit codes a byte along the last axis, low nibble first.

byte[i] = codes[2i] | codes[2i + 1] << 4. An odd last axis is padded with one zero nibble; unpack_int4
needs the original length to drop it (it refuses a length that does not match the packed size).
"""

from __future__ import annotations

import torch

from pagedllm.errors import InputError


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes in 0..15 -> [..., ceil(n / 2)] uint8."""
    codes = torch.as_tensor(codes)
    if codes.dim() == 0:
        codes = codes.reshape(1)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.dtype.is_complex:
        raise InputError(f"pack_int4 needs integer codes, got {codes.dtype}", param="codes")
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise InputError(
            f"INT4 codes must lie in 0..15, got {int(codes.min())}..{int(codes.max())}", param="codes"
        )
    c = codes.to(torch.uint8)
    if c.shape[-1] % 2:  # pad one zero nibble so pairs line up
        c = torch.nn.functional.pad(c, (0, 1))
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Inverse of pack_int4: [..., m] uint8 -> [..., length] uint8 (length defaults to 2m)."""
    packed = torch.as_tensor(packed)
    if packed.dtype != torch.uint8:
        raise InputError(f"unpack_int4 needs uint8 bytes, got {packed.dtype}", param="packed")
    m = packed.shape[-1] if packed.dim() else 1
    packed = packed.reshape(*packed.shape[:-1], m) if packed.dim() else packed.reshape(1)
    if length is None:
        length = 2 * m
    if isinstance(length, bool) or not isinstance(length, int) or length not in (2 * m - 1, 2 * m):
        raise InputError(
            f"length {length!r} does not match {m} packed bytes (expected {2 * m - 1} or {2 * m})",
            param="length",
        )
    low = packed & 0x0F
    high = packed >> 4
    out = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], 2 * m)
    return out[..., :length]
