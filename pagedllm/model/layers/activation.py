"""SiLU-and-multiply, the gate of a Llama MLP: silu(gate) * up over a fused [.., 2F] gate_up projection.

The named op the model calls: the C++ kernel (one pass, rounding as the torch code rounds) where the op
table (ops.py) chose it, else the torch reference below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.model.layers import cpu_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernel = cpu_ops.usable(gate_up)
    if kernel is not None and gate_up.dim() == 2:
        return kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
