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
    idx = np.asarray(block_ids, dtype=np.int64)
    # per plane, K then V, one gather each, block-major: a block's slice of each is one contiguous run of
    # bytes, K then V as in the plane's [2, ...]. numpy's gather, one thread: torch's spreads these small
    # copies over its threads and was 4-10x slower on a busy machine
    rows = [
        p[kv].view(torch.uint8).numpy()[idx].reshape(len(block_ids), -1)
        for p in _planes(kv_caches)
        for kv in (0, 1)
    ]
    return [b"".join(r[i].data for r in rows) for i in range(len(block_ids))]


def load_blocks(kv_caches: list, loads: list[tuple[int, bytes]]) -> None:
    """Fill each (block_id, bytes) block with bytes from save_blocks (of a cache of the same layout)."""
    if not loads:
        return
    planes = _planes(kv_caches)
    sizes = [_plane_bytes(p) for p in planes]
    for block_id, payload in loads:
        if len(payload) != sum(sizes):
            raise ValueError(f"a KV block payload of {len(payload)} bytes, the cache's are {sum(sizes)}")
        # a block's bytes per plane are contiguous: copied straight in (a strided byte copy of all the
        # blocks at once was 20x slower)
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for plane, size in zip(planes, sizes):
            piece = flat[offset : offset + size].view(plane.dtype).view(2, *plane.shape[2:])
            plane[:, block_id].copy_(piece)
            offset += size
