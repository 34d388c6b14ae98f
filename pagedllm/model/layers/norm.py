"""RMSNorm, computed in float32 like the reference implementation so bf16 runs round the same way.

On the CPU it runs as one C++ call (cpu_ops.py) that rounds where the torch code below rounds; the
residual add that precedes a norm inside a decoder layer can go with it (`add_forward`).
GemmaRMSNorm is Gemma 2/3's: the weight is stored zero-centred and applied as (1 + weight), multiplied in
float32 before the cast back (Llama casts first, then multiplies), so it keeps to the torch code.
"""

import torch
from torch import nn

from pagedllm.model.layers import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._ops(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)); neither input is modified."""
        ops = self._ops(x)
        if ops is not None:
            return tuple(ops.add_rms_norm(x, residual, self.weight, self.eps))
        total = residual + x
        return total, self._norm(total)

    def _ops(self, x: torch.Tensor):
        if x.dim() != 2 or x.stride(-1) != 1 or self.weight.dtype != x.dtype:
            return None
        return cpu_ops.usable(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)  # (1 + 0): the identity scale, as transformers initialises it

    def _ops(self, x: torch.Tensor):
        return None  # the C++ kernel computes Llama's rounding and weight, not this

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
