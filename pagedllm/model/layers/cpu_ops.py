"""The C++ element-wise layer ops (csrc/layer_ops.cpp): RMSNorm, residual add + RMSNorm, SiLU-and-multiply
and rotary, one call each instead of 4-10 torch ops. The op table (ops.py) hands out the module; where it
gives none (no compiler, PAGEDLLM_NO_CPU_KERNEL=1, or forced(layer_ops="torch")) the layers run their
torch code, which rounds the same way.
"""

from __future__ import annotations

import torch

from pagedllm import ops


def usable(x: torch.Tensor):
    """The ops module when x can go through it (CPU, no autograd), else None."""
    if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return ops.kernel("layer_ops")
