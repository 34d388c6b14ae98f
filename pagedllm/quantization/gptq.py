"""GPTQ: one-shot weight quantization with second-order error feedback (Frantar et al. 2022), per layer.

For a linear with calibration inputs X, minimise ||X W^T - X W_q^T||^2 one column at a time: after
rounding column j, spread its error over the columns not yet quantized, weighted by the inverse Hessian
H^-1 = (2 X^T X)^-1. The upper Cholesky factor of H^-1 holds exactly the rows that update needs, and
working in blocks of 128 columns turns most of the update into one matmul per block.

Codes and (scale, zero) are the project's asymmetric uniform grid (round-half-up), group-wise along
in_features, so the result has the same layout as round-to-nearest and dequantizes the same way.
Each group's (scale, zero) is computed when quantization enters the group, from its current weights
(already updated by the error of earlier columns), as in the reference implementation.

act_order quantizes columns in order of decreasing diag(H) (the most active inputs first, while the most
columns are left to absorb their error). Groups stay contiguous runs of in_features (the storage
layout), so with act_order every group's parameters are fixed up front from the original weights and
each column uses its own group's (the reference's "static groups").
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.errors import InputError
from pagedllm.quantization.calib import (
    check_group_size,
    collect_inputs,
    quantize_layers,
    split_rows,
    weight_qparams,
    weight_tensor,
)
from pagedllm.quantization.uniform import QuantizedTensor, check_bits, qparams, round_half_up


def gptq_quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int = 4,
    group_size: int | None = 32,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> QuantizedTensor:
    """Quantize one [out, in] weight given H = 2 X^T X [in, in] of its calibration inputs."""
    check_bits(bits)
    if not 0 <= damp:
        raise InputError(f"damp must be >= 0, got {damp!r}", param="damp")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"block_size must be a whole number >= 1, got {block_size!r}", param="block_size")
    W = weight.detach().float().clone()
    rows, cols = W.shape
    gs = group_size or cols
    if cols % gs:
        raise InputError(f"group_size {gs} does not divide in_features {cols}", param="group_size")
    H = hessian.detach().float().clone()
    levels = 2**bits - 1

    # inputs that never fire carry no information: fix their weight to 0 and keep H invertible
    dead = H.diag() == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    static = act_order or group_size is None
    if static:  # per-channel or act-order: parameters from the original weights, fixed up front
        scale, zero = weight_qparams(W, bits, group_size)
        scale, zero = scale.reshape(rows, -1), zero.reshape(rows, -1)
    else:
        scale = torch.zeros(rows, cols // gs)
        zero = torch.zeros(rows, cols // gs)
        block_size = max(gs, block_size // gs * gs)  # groups never straddle blocks
    perm = torch.argsort(H.diag(), descending=True) if act_order else torch.arange(cols)
    if act_order:
        W, H = W[:, perm], H[perm][:, perm]

    H += damp * H.diag().mean() * torch.eye(cols)
    # upper Cholesky factor of H^-1: row j holds how column j's error moves the columns after it
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros_like(W)
    group_of = perm // gs  # group of the column quantized at each step
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if not static and c % gs == 0:  # entering a group: its range from the updated weights
                grp = W1[:, i : i + gs]
                scale[:, c // gs], zero[:, c // gs] = qparams(grp.amin(1), grp.amax(1), bits)
            s, z = scale[:, group_of[c]], zero[:, group_of[c]]
            w = W1[:, i]
            q = torch.clamp(round_half_up(w / s) + z, 0, levels)
            Q[:, c] = q
            err = (w - s * (q - z)) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if act_order:
        Q = Q[:, torch.argsort(perm)]
    if group_size is None:
        scale, zero = scale[:, 0], zero[:, 0]
    return weight_tensor(Q, scale, zero, bits, group_size)


# Linears that read the same input share one Hessian, and GPTQ treats rows independently: quantize the
# group as one stacked matrix (half the column loops) and cut it apart afterwards.
_GROUPS = (
    ("self_attn.q_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.o_proj", ("self_attn.o_proj",)),
    ("mlp.gate_proj", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.down_proj", ("mlp.down_proj",)),
)


def gptq_quantize_layer(
    layer: nn.Module,
    xs: list[torch.Tensor],
    rotary,
    bits: int = 4,
    group_size: int | None = 32,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> dict[str, QuantizedTensor]:
    """GPTQ on every linear of one float32 decoder layer; names relative to the layer."""
    hessians: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        h = 2 * x.T @ x
        hessians[name] = h if name not in hessians else hessians[name] + h
        counts[name] = counts.get(name, 0) + x.shape[0]

    collect_inputs(layer, xs, rotary, tuple(inp for inp, _ in _GROUPS), on_input=add)
    modules = dict(layer.named_modules())
    out: dict[str, QuantizedTensor] = {}
    for inp, names in _GROUPS:
        weights = [modules[n].weight.detach() for n in names]
        qt = gptq_quantize_weight(
            torch.cat(weights),
            hessians[inp] / counts[inp],
            bits,
            group_size,
            act_order,
            damp,
            block_size,
        )
        out.update(zip(names, split_rows(qt, [w.shape[0] for w in weights])))
    return out


def gptq_quantize_model(
    model: nn.Module,
    calib: list[torch.Tensor],
    bits: int = 4,
    group_size: int | None = 32,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    show_progress: bool = True,
) -> dict[str, QuantizedTensor]:
    """GPTQ for every decoder layer; returns {"model.layers.i.mlp.down_proj": QuantizedTensor, ...}.

    The model itself is not changed.
    """
    check_bits(bits)
    check_group_size(model, group_size)

    def one(layer, xs, rotary):
        return gptq_quantize_layer(layer, xs, rotary, bits, group_size, act_order, damp, block_size)

    return quantize_layers(model, calib, one, desc=f"GPTQ int{bits}", show_progress=show_progress)


__all__ = ["gptq_quantize_model", "gptq_quantize_layer", "gptq_quantize_weight"]
