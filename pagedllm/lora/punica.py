"""The `lora` op: each row of a batch through its own adapter, all rows in one shrink and one expand.

Layout (layers.py keeps it): a linear's adapters are stacked over the S device slots and its n output
slices (q/k/v of a fused qkv, gate/up of a fused gate_up), R = max_lora_rank rows each:

    a    [S * n * R, in]    slot s, slice i at rows (s * n + i) * R ...; a rank below R is zero-padded
    b_t  [S * n * R, out]   B transposed, block-diagonal over slices: slice i's outputs read only its own
                            R rows; the adapter's scaling is folded in
    mask [T, S * n * R]     1 where the row's adapter holds that slot, else 0 (a base row: all 0)

    delta = ((x @ a.T) * mask) @ b_t

The shrink computes every slot's product for every row and the mask keeps each row's own (S-LoRA /
Punica's grouped product without a gather of per-row weight copies, which for a prompt of T rows would be
T x R x in floats); the zeros add exactly nothing. Only the slots up to the highest one this step uses are
passed (a prefix of the rows: views, no copy; slots are taken lowest first), so one adapter costs n * R
columns whatever max_loras is. Its cost per row is k * n * R * (in + out) multiply-adds for k slots in use,
beside the base linear's in * out: on a 2048-wide model 8 rank-16 adapters add about 12% to a single-slice
linear, 30% to the fused q/k/v (its B is dense over the three slices). One call per linear per step, whatever
mix of adapters and base rows it holds. ops.py names the op; the torch reference is its only backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import ops


def lora_shrink_expand_native(
    x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    return torch.mm(F.linear(x, a) * mask, b_t)


def lora_shrink_expand(
    x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Every row's adapter product (see the module docstring), by the backend the op table chose."""
    kernel = ops.kernel("lora")  # None: the torch reference runs (no C++ backend yet)
    if kernel is not None:
        return kernel.lora_shrink_expand(x, a, b_t, mask)
    return lora_shrink_expand_native(x, a, b_t, mask)
