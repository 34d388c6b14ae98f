"""The `lora` op: each row of a batch through its own adapter, added to its linear's output in one call.

Layout (layers.py keeps it): a linear's adapters are stacked over the S device slots and its n output
slices (q/k/v of a fused qkv, gate/up of a fused gate_up), R = max_lora_rank rows each:

    a    [S * n * R, in]    slot s, slice i at rows (s * n + i) * R ...; a rank below R is zero-padded
    b_t  [S * n * R, out]   B transposed, block-diagonal over slices: slice i's outputs read only its own
                            R rows; the adapter's scaling is folded in
    row_slots [T]           each row's slot, -1 for a base row

Two backends (ops.py chooses):
- C++ (csrc/lora.h, also called from the fused decoder stack): each row reads only its own slot's A rows and
  each slice's own block of B_t, in float32 arithmetic, added to y in place. A decode step's cost is the
  bytes of one adapter's weights; for a 16-bit model it reads their bf16 copy (half the bytes).
- the torch reference: the masked stacked product (S-LoRA / Punica's grouped product without a gather of
  per-row weight copies, which for a prompt of T rows would be T x R x in floats)

      delta = ((x @ a.T) * mask) @ b_t,   mask [T, S * n * R]: 1 where the row's adapter holds that slot

  over the slots up to the highest one this step uses (a prefix of the rows: views, no copy); the zeros add
  exactly nothing. Few rows in float32 (ATen's bf16 gemm takes ~170 us for a 1-row product that MKL's
  sgemm does in ~10 us), many rows in the model's 16-bit dtype, where its gemm is the faster.

Either is one call per linear per step, whatever mix of adapters and base rows it holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import ops

# the reference computes steps of at most this many rows in float32, more in the model's 16-bit dtype
FLOAT32_MAX_ROWS = 8


def lora_shrink_expand_native(
    x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    return torch.mm(F.linear(x, a) * mask, b_t)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    full: tuple[torch.Tensor, torch.Tensor],
    half: tuple[torch.Tensor, torch.Tensor] | None,
    batch,
    widths: list[int],
) -> torch.Tensor:
    """y + every row's adapter product (see the module docstring), by the backend the op table chose.
    full: the float32 (a, b_t); half: their copy in a 16-bit model's dtype, or None; batch: the step's
    LoRABatch (row_slots, rank, the reference's masks); widths: the slices' output widths."""
    kernel = ops.kernel("lora")
    if kernel is not None and x.dtype == y.dtype:
        a, b_t = half or full  # a 16-bit model's copy: half the bytes a decode step streams
        return kernel.add_lora(y.contiguous(), x.contiguous(), a, b_t, batch.row_slots, batch.rank, widths)
    a, b_t = half if half is not None and x.shape[0] > FLOAT32_MAX_ROWS else full
    rows = batch.num_slots_used * len(widths) * batch.rank
    delta = lora_shrink_expand_native(x.to(a.dtype), a[:rows], b_t[:rows], batch.mask(len(widths), a.dtype))
    return y + delta.to(y.dtype)
