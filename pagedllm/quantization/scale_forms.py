"""The forms a kernel layout keeps a quantized layer's scales and mins in, and the checks that pick the smallest
exact one (the AVX2 layout, avx2.py, and the AMX layout, amx.py, share them): float16 where that holds every
value, mins derived from the scales (GGUF's symmetric types: m = c x s, c a power of two), and K-quant super-
blocks (scales = d x int8 codes), each exactly the float32 values the reference dequantizes with."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.quantization.gguf_blocks import SuperBlocks


def exact_in_float16(t: torch.Tensor) -> bool:
    """Whether float16 holds every value of t exactly (GGUF stores its block scales and mins so)."""
    return bool(torch.equal(t.half().float(), t))


MIN_FACTORS = (-8, -16, -32, -128)  # GGUF's symmetric types: Q4_0, Q5_0, Q6_K, Q8_0 (m = -offset x d)


def min_factor_of(scales: torch.Tensor, mins: torch.Tensor) -> int | None:
    """The power of two c with mins == c x scales exactly (then the layout keeps c, not the mins), or None."""
    if not scales.numel():
        return None
    at = int(scales.abs().argmax())  # a nonzero scale, if any (an all-zero row block has 0 for both)
    if float(scales.flatten()[at]) == 0:
        return None
    ratio = float(mins.flatten()[at]) / float(scales.flatten()[at])
    c = next((c for c in MIN_FACTORS if c == ratio), None)
    return c if c is not None and torch.equal(mins, c * scales) else None


def factors(sb: SuperBlocks, scales: torch.Tensor, mins: torch.Tensor, with_mins: bool = True) -> bool:
    """Whether the super-blocks give exactly these scales and mins (and fit the kernel: a power-of-two count
    of groups a super-block, float16 super-scales as GGUF stores them)."""
    g = sb.groups
    if g < 1 or g & (g - 1) or scales.shape[1] % g or sb.scale_codes.shape != scales.shape:
        return False
    if not exact_in_float16(sb.d.float()) or (with_mins and not exact_in_float16(sb.dmin.float())):
        return False

    n = scales.shape[0]

    def equal(d: torch.Tensor, q: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.equal(d.float().unsqueeze(-1) * q.view(n, -1, g), want.float().view(n, -1, g))

    return equal(sb.d, sb.scale_codes, scales) and (not with_mins or equal(sb.dmin, sb.min_codes, mins))
