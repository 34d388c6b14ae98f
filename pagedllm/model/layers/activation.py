"""SiLU-and-multiply, the gate of a Llama MLP: silu(gate) * up over a fused [.., 2F] gate_up projection;
and GeGLU's gelu(gate) * up (tanh approximation, Gemma's gelu_pytorch_tanh).

silu_and_mul is the named op the model calls: the C++ kernel (one pass, rounding as the torch code rounds)
where the op table (ops.py) chose it, else the torch reference below. GeGLU has the torch code only.
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


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def act_and_mul(gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """act(gate) * up over [.., 2F]: the MLP's gate for config.hidden_act (one of ACTIVATIONS)."""
    if hidden_act == "silu":
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate, hidden_act) * up


def act(x: torch.Tensor, hidden_act: str) -> torch.Tensor:
    if hidden_act == "silu":
        return F.silu(x)
    if hidden_act == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
