"""Helpers shared by the quantized-kernel tests."""

from __future__ import annotations

import torch


def rounded_x(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """x as the int8 kernels see it (csrc/woq_avx2.h's quantize_row, which the AVX2 kernel and the AMX
    layout's gemv share): per 32-block codes round(x * 127 / max|x|) times max|x| / 127, float32; per
    `span` inputs for quantize_row_span (Q4_K's and Q6_K's 256-input super-blocks)."""
    b = x.float().view(x.shape[0], -1, span)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).view(x.shape[0], -1)
