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

    def window_start(self, i: int, window: int | None) -> int:
        """The first position prefill i's chunk reads, down to its block's start: under a sliding window
        its first query (position seq_len - n) sees keys from seq_len - n - window + 1 on."""
        if window is None:
            return 0
        n = self.query_start_loc[i + 1] - self.query_start_loc[i]
        first = max(0, self.seq_lens[i] - n - window + 1)
        return first // self.block_size * self.block_size

    def prefix_mask(self, i: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor | None:
        """Prefill i's additive attention mask [n, context - window_start] in dtype (0 where query j, at
        position prefix + j, sees the key; -inf where not: past it, or with a window at or before
        prefix + j - window) when its chunk follows cached tokens or a window applies, else None (plain
        causal). SDPA turns a boolean mask into this same tensor on every call; made once a step, it is
        shared by every layer."""
        n = self.query_start_loc[i + 1] - self.query_start_loc[i]
        prefix = self.seq_lens[i] - n
        if prefix == 0 and (window is None or n <= window):
            return None
        key = (i, dtype, window)
        if key not in self._prefix_masks:
            start = self.window_start(i, window) if prefix else 0  # a fresh prompt's K/V are all there
            queries = (prefix + torch.arange(n))[:, None]
            keys = torch.arange(start, self.seq_lens[i])[None, :]
            sees = keys <= queries
            if window is not None:
                sees &= keys > queries - window
            self._prefix_masks[key] = torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, float("-inf"))
        return self._prefix_masks[key]
