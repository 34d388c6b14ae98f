"""Copies whole KV blocks out of the paged cache as bytes, and bytes back into it (--kv-offload-dir).

One block's bytes are every layer's K and V of its block_size slots (and, for an int8 / fp8 cache, their
per-token scales), layer after layer: the disk store (core/kv_offload.py) keeps them as they are. Blocks
are copied in one gather per cache tensor, so a step that evicts many blocks pays one copy, not many.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedllm.attention.kv_quant import QuantizedKVCache


def _planes(kv_caches: list) -> list[torch.Tensor]:
    """Every tensor holding a block's state, each [2, num_blocks, ...]: a float cache is one, a quantized
    cache its codes (as raw bytes: torch cannot index float8) and its scales."""
    out = []
    for cache in kv_caches:
        out.extend((cache.raw, cache.scale) if isinstance(cache, QuantizedKVCache) else (cache,))
    return out


def _plane_bytes(plane: torch.Tensor) -> int:
    """Bytes of one block in this plane: K and V, its slots."""
    return 2 * math.prod(plane.shape[2:]) * plane.element_size()


def block_bytes(kv_caches: list) -> int:
    """Bytes of one block, all layers."""
    return sum(_plane_bytes(p) for p in _planes(kv_caches))


def save_blocks(kv_caches: list, block_ids: list[int]) -> list[bytes]:
    """Each block's bytes, in block_ids' order (a copy: the block may be overwritten right after)."""
    if not block_ids:
        return []
    idx = torch.tensor(block_ids, dtype=torch.long)
    n = len(block_ids)
    rows = [
        p[:, idx].transpose(0, 1).contiguous().view(torch.uint8).reshape(n, -1) for p in _planes(kv_caches)
    ]
    flat = torch.cat(rows, dim=1).numpy()
    return [flat[i].tobytes() for i in range(n)]


def load_blocks(kv_caches: list, loads: list[tuple[int, bytes]]) -> None:
    """Fill each (block_id, bytes) block with bytes from save_blocks (of a cache of the same layout)."""
    if not loads:
        return
    planes = _planes(kv_caches)
    width = sum(_plane_bytes(p) for p in planes)
    n = len(loads)
    buf = bytearray(b"".join(payload for _, payload in loads))  # writable: torch.from_numpy wants that
    if len(buf) != n * width:
        raise ValueError(f"KV block payloads of {len(buf) // max(n, 1)} bytes, the cache's are {width}")
    flat = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8).reshape(n, width))
    idx = torch.tensor([block_id for block_id, _ in loads], dtype=torch.long)
    offset = 0
    for plane in planes:
        size = _plane_bytes(plane)
        piece = flat[:, offset : offset + size].contiguous().view(plane.dtype)
        plane[:, idx] = piece.reshape(n, 2, *plane.shape[2:]).transpose(0, 1)
        offset += size
