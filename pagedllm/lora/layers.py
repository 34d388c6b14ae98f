"""LoRALinear: a served decoder linear plus the stacked weights of the adapters in the device slots.

It wraps whatever linear the model serves with (float nn.Linear, prepacked bf16, int8/int4/GGUF QuantLinear,
a fused qkv or gate_up): the base runs as before, once for all rows, and the adapters' product (the `lora`
op, punica.py) is added after it, in float32 arithmetic; the base stays quantized, the adapters float.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.lora.punica import add_lora


class LoRABatch:
    """This step's row -> slot assignment, shared by every LoRALinear of the model (set by the manager
    before each forward). `mask(n)`: the [T, S * n * R] row mask for linears of n slices, built once a step."""

    def __init__(self, num_slots: int, rank: int):
        self.num_slots, self.rank = num_slots, rank
        self.active = False  # any row with an adapter this step; a base-only step adds nothing
        self.row_slots = torch.empty(0, dtype=torch.long)  # [T] each row's slot, -1 for base rows
        self.num_slots_used = 0  # slots 0 .. this - 1 are passed to the op (the highest in use, plus one)
        self._one_hot: torch.Tensor | None = None  # [T, num_slots_used]
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set(self, row_slots: torch.Tensor | None, num_slots_used: int | None = None) -> None:
        """row_slots: [T] slot of each row, -1 for base rows; None: no adapter row this step.
        num_slots_used: the highest slot in row_slots plus one, where the caller knows it."""
        self._masks.clear()
        self._one_hot = None
        if row_slots is None:
            self.active, self.row_slots = False, torch.empty(0, dtype=torch.long)
            return
        self.active = True
        self.row_slots = row_slots.to(torch.long).contiguous()
        self.num_slots_used = int(row_slots.max()) + 1 if num_slots_used is None else num_slots_used

    def mask(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The reference backend's row mask (built on first use in a step: the C++ one reads row_slots)."""
        if self._one_hot is None:
            one_hot = torch.zeros(self.row_slots.shape[0], self.num_slots_used + 1)
            one_hot[torch.arange(self.row_slots.shape[0]), self.row_slots.clamp(min=-1) + 1] = 1.0
            self._one_hot = one_hot[:, 1:]  # column 0 took the base rows
        key = (n, dtype)
        if key not in self._masks:
            self._masks[key] = self._one_hot.to(dtype).repeat_interleave(n * self.rank, dim=1)
        return self._masks[key]


class LoRALinear(nn.Module):
    """base(x) + every row's adapter product. slices: (PEFT module name, output width) in the base's
    output order, e.g. (("q_proj", 1024), ("k_proj", 256), ("v_proj", 256)) for a fused qkv."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slices: tuple[tuple[str, int], ...],
        batch: LoRABatch,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.base = base
        self.slices = slices
        self.widths = [w for _, w in slices]  # the slices' output widths, as the op takes them
        self.batch = batch
        s, n, r = batch.num_slots, len(slices), batch.rank
        self.out_offsets = [sum(w for _, w in slices[:i]) for i in range(n)]
        out = sum(w for _, w in slices)
        # buffers, not parameters: load_weights / state_dict of the base model never see them. float32
        # always; for a bf16 / fp16 model a copy in its dtype too (see forward)
        self.register_buffer("lora_a", torch.zeros(s * n * r, in_features), persistent=False)
        # B transposed ([rows, out]): a prefix of slots is a contiguous view of both
        self.register_buffer("lora_b", torch.zeros(s * n * r, out), persistent=False)
        half = dtype != torch.float32
        self.register_buffer("lora_a_half", self.lora_a.to(dtype) if half else None, persistent=False)
        self.register_buffer("lora_b_half", self.lora_b.to(dtype) if half else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.batch.active:
            return y
        return add_lora(y, x, (self.lora_a, self.lora_b), self._half(), self.batch, self.widths)

    def _half(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.lora_a_half, self.lora_b_half) if self.lora_a_half is not None else None

    def kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (a, b_t) buffers the C++ backend reads (the fused decoder stack holds them too): a 16-bit
        model's copy, else the float32 ones (punica.add_lora picks the same)."""
        return self._half() or (self.lora_a, self.lora_b)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's slices into `slot` (zeros where it has no adapter for a slice)."""
        n, r = len(self.slices), self.batch.rank
        first = slot * n * r
        with torch.no_grad():
            self.lora_a[first : first + n * r] = 0
            self.lora_b[first : first + n * r] = 0
            for i, (name, width) in enumerate(self.slices):
                if name not in weights:
                    continue
                a, b = weights[name]
                rank = a.shape[0]
                row = first + i * r
                self.lora_a[row : row + rank] = a
                off = self.out_offsets[i]
                self.lora_b[row : row + rank, off : off + width] = b.T
            if self.lora_a_half is not None:
                self.lora_a_half[first : first + n * r] = self.lora_a[first : first + n * r]
                self.lora_b_half[first : first + n * r] = self.lora_b[first : first + n * r]

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, {})
