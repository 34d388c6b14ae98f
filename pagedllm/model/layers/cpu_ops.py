"""The C++ element-wise layer ops (csrc/layer_ops.cpp), compiled on first use (pagedllm/cpp_extension.py):
RMSNorm, residual add + RMSNorm, SiLU-and-multiply and rotary, one call each instead of 4-10 torch ops.

`load()` returns None without a compiler or with PAGEDLLM_NO_CPU_KERNEL=1; the layers then run their
torch code, which rounds the same way.
"""

from __future__ import annotations

import torch

from pagedllm import kernels, ops


def load():
    return kernels.load("layer_ops")


def usable(x: torch.Tensor):
    """The ops module when x can go through it (CPU, no autograd), else None."""
    if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return load() if ops.backend("layer_ops") != "torch" else None
