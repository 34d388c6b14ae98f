"""The C++ element-wise layer ops (csrc/layer_ops.cpp), compiled on first use (pagedllm/cpp_extension.py):
RMSNorm, residual add + RMSNorm, SiLU-and-multiply and rotary, one call each instead of 4-10 torch ops.

`load()` returns None without a compiler or with PAGEDLLM_NO_CPU_KERNEL=1; the layers then run their
torch code, which rounds the same way.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from pagedllm.cpp_extension import load_cpp_extension

SOURCE = Path(__file__).parent / "csrc" / "layer_ops.cpp"


@cache
def load():
    return load_cpp_extension("pagedllm_layer_ops", SOURCE)


def usable(x: torch.Tensor):
    """The ops module when x can go through it (CPU, no autograd), else None."""
    if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return load()
