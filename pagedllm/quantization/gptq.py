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
each column uses its own group's (the reference's "static groups"). act_order is the default: on the
default model it recovers more than twice as much of RTN's loss as left-to-right order.

Those fixed parameters come from a range search by default (ranges="search"): each group's [min, max]
is shrunk, both ends together and then each alone, where that lowers the group's rounding error
weighted by its block of H. The default model's checkpoint is Q4_1, so every group's weights already lie
on a 16-level grid from its min to its max, and the integer zero point shifts RTN's grid off them by up
to half a step; choosing the range also chooses that shift. Then true_sequential (the reference's
default) quantizes q/k/v, o, gate/up, down in that order, each from the inputs the already-quantized
linears before it produce.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.errors import InputError
from pagedllm.quantization.calib import (
    check_group_size,
    collect_inputs,
    quantize_layers,
    search_ranges,
    split_rows,
    weight_qparams,
    weight_tensor,
)
from pagedllm.quantization.uniform import QuantizedTensor, check_bits, dequantize, qparams, round_half_up

RANGES = ("minmax", "shrink", "search")


def _group_qparams(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None, ranges: str):
    """(scale, zero) of w's groups from their min/max, or from a range search weighted by h's blocks."""
    if ranges == "minmax":
        return weight_qparams(w, bits, group_size)
    return qparams(*search_ranges(w, h, bits, group_size, asymmetric=ranges == "search"), bits)


def gptq_quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int = 4,
    group_size: int | None = 32,
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    ranges: str = "search",
) -> QuantizedTensor:
    """Quantize one [out, in] weight given H = 2 X^T X [in, in] of its calibration inputs.

    ranges picks each group's [rmin, rmax], hence its (scale, zero): "minmax" the weights' own range;
    "shrink" AWQ's clipping grid (both ends scaled by one factor, down to half); "search" that, then
    each end alone on that grid (calib.search_ranges), which also chooses where the integer zero
    point puts the grid. The searches minimise the group's rounding error weighted by its diagonal block
    of H (the output error before any feedback), like the reference's MSE range search.
    """
    check_bits(bits)
    if ranges not in RANGES:
        raise InputError(f"ranges must be one of {', '.join(RANGES)}, got {ranges!r}", param="ranges")
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
        scale, zero = _group_qparams(W, H, bits, group_size, ranges)
        scale, zero = scale.reshape(rows, -1), zero.reshape(rows, -1)
    else:
        scale = torch.zeros(rows, cols // gs)
        zero = torch.zeros(rows, cols // gs)
        block_size = max(gs, block_size // gs * gs)  # groups never straddle blocks
    H0 = H if static else H.clone()  # dynamic groups search their ranges on the undamped blocks
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
                sz = _group_qparams(W1[:, i : i + gs], H0[c : c + gs, c : c + gs], bits, gs, ranges)
                scale[:, c // gs], zero[:, c // gs] = sz[0][:, 0], sz[1][:, 0]
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
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    true_sequential: bool = True,
    ranges: str = "search",
) -> dict[str, QuantizedTensor]:
    """GPTQ on every linear of one float32 decoder layer; names relative to the layer.

    true_sequential (the reference's default) quantizes the groups in data-flow order, q/k/v, o, gate/up,
    down, and takes each group's Hessian from the layer with the groups before it already quantized, so
    o_proj is fitted to the inputs the quantized attention really gives it. Otherwise every Hessian comes
    from one pass of the float layer. The layer's weights are left as they were.
    """
    modules = dict(layer.named_modules())
    originals = {n: modules[n].weight.detach().clone() for _, names in _GROUPS for n in names}
    hessians: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        h = 2 * x.T @ x
        hessians[name] = h if name not in hessians else hessians[name] + h
        counts[name] = counts.get(name, 0) + x.shape[0]

    if not true_sequential:
        collect_inputs(layer, xs, rotary, tuple(inp for inp, _ in _GROUPS), on_input=add)
    out: dict[str, QuantizedTensor] = {}
    try:
        for inp, names in _GROUPS:
            if true_sequential:
                collect_inputs(layer, xs, rotary, (inp,), on_input=add, stop_early=True)
            weights = [modules[n].weight.detach() for n in names]
            qt = gptq_quantize_weight(
                torch.cat(weights),
                hessians.pop(inp) / counts[inp],
                bits,
                group_size,
                act_order,
                damp,
                block_size,
                ranges,
            )
            parts = split_rows(qt, [w.shape[0] for w in weights])
            out.update(zip(names, parts))
            if true_sequential:  # the later groups see this group's quantized outputs
                with torch.no_grad():
                    for n, part in zip(names, parts):
                        modules[n].weight.copy_(dequantize(part).to(modules[n].weight.dtype))
    finally:
        with torch.no_grad():
            for n, w in originals.items():
                modules[n].weight.copy_(w)
    return out


def gptq_quantize_model(
    model: nn.Module,
    calib: list[torch.Tensor],
    bits: int = 4,
    group_size: int | None = 32,
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    show_progress: bool = True,
    true_sequential: bool = True,
    ranges: str = "search",
) -> dict[str, QuantizedTensor]:
    """GPTQ for every decoder layer; returns {"model.layers.i.mlp.down_proj": QuantizedTensor, ...}.

    act_order and true_sequential (see gptq_quantize_layer) are on by default, as in the reference
    implementations. The model itself is not changed.
    """
    check_bits(bits)
    check_group_size(model, group_size)

    def one(layer, xs, rotary):
        return gptq_quantize_layer(
            layer, xs, rotary, bits, group_size, act_order, damp, block_size, true_sequential, ranges
        )

    return quantize_layers(model, calib, one, desc=f"GPTQ int{bits}", show_progress=show_progress)


__all__ = ["gptq_quantize_model", "gptq_quantize_layer", "gptq_quantize_weight"]
