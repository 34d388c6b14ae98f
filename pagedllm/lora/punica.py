"""The `lora` op: each row of a batch through its own adapter, all rows in one shrink and one expand.

Layout (layers.py keeps it): a linear's adapters are stacked over the S device slots and its n output
slices (q/k/v of a fused qkv, gate/up of a fused gate_up), R = max_lora_rank rows each:

    a    [S * n * R, in]    slot s, slice i at rows (s * n + i) * R ...; a rank below R is zero-padded
    b    [out, S * n * R]   block-diagonal over slices: slice i's outputs read only its own R columns;
                            the adapter's scaling is folded in
    mask [T, S * n * R]     1 where the row's adapter holds that slot, else 0 (a base row: all 0)

    delta = ((x @ a.T) * mask) @ b.T

The shrink computes every slot's product for every row and the mask keeps each row's own (S-LoRA /
Punica's grouped product without a gather of per-row weight copies, which for a prompt of T rows would be
T x R x in floats); the zeros add exactly nothing. Its cost is S * n * R columns per row beside the base
linear's `in` (8 slots of rank 16 on a 2048-wide model: about 6%). One call per linear per step, whatever
mix of adapters and base rows it holds. ops.py names the op; the torch reference is its only backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import ops


def lora_shrink_expand_native(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    return F.linear(F.linear(x, a) * mask, b)


def lora_shrink_expand(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every row's adapter product (see the module docstring), by the backend the op table chose."""
    kernel = ops.kernel("lora")  # None: the torch reference runs (no C++ backend yet)
    if kernel is not None:
        return kernel.lora_shrink_expand(x, a, b, mask)
    return lora_shrink_expand_native(x, a, b, mask)
