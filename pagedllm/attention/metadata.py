"""What one step's attention needs to know about the batch: where to write new K/V, where to read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """A flat batch of T new tokens from B sequences.

    Sequences with one new token (decodes) come first, then prefills (a whole prompt or a chunk of one),
    so decode rows can be attended in one batched call.
    """

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset, where each new token's K/V goes
    query_start_loc: list[int]  # [B + 1] cumulative new-token counts (host ints: loop bounds)
    seq_lens: list[int]  # [B] context length after this step (cached prefix + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    seq_lens_tensor: torch.Tensor  # [B] long, the same as seq_lens
    block_size: int = 16
    _prefix_masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def prefix_mask(self, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Prefill i's additive attention mask [n, context] in dtype (0 where query j, at position
        prefix + j, sees key 0..prefix + j; -inf past it) when its chunk follows cached tokens, else None
        (plain causal). SDPA turns a boolean mask into this same tensor on every call; made once a step,
        it is shared by every layer."""
        n = self.query_start_loc[i + 1] - self.query_start_loc[i]
        prefix = self.seq_lens[i] - n
        if prefix == 0:
            return None
        key = (i, dtype)
        if key not in self._prefix_masks:
            sees = torch.arange(self.seq_lens[i])[None, :] <= (prefix + torch.arange(n))[:, None]
            self._prefix_masks[key] = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, float("-inf"))
        return self._prefix_masks[key]
