"""Round-to-nearest (RTN) weight quantization: uniform.py's quantizer applied to each [out, in] weight.

INT8 (and any bits without a group size): one (s, z) pair per output channel. Smaller widths: group-wise
along the input dimension, so each output row gets in / group_size pairs (what the INT4 kernel reads).
"""

from __future__ import annotations

import torch

from pagedllm.errors import InputError
from pagedllm.quantization.uniform import QuantizedTensor, quantize


def rtn_quantize_weight(weight: torch.Tensor, bits: int, group_size: int | None = None) -> QuantizedTensor:
    """[out, in] weight -> codes with per-channel (group_size None) or group-wise (along in) scales."""
    if weight.dim() != 2:
        raise InputError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}", param="weight")
    w = weight.detach().float()
    if group_size is None:
        return quantize(w, bits, axis=0)
    return quantize(w, bits, axis=1, group_size=group_size)


def rtn_method(name: str, weight: torch.Tensor, bits: int, group_size: int | None) -> QuantizedTensor:
    """rtn_quantize_weight in quantize_model's plug-in signature (RTN needs no layer name)."""
    return rtn_quantize_weight(weight, bits, group_size)
