"""Paged attention in plain torch for the CPU.

K and V live in one cache tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]. No
sequence has a contiguous cache: every read goes through its block table. Decodes (one query each)
are attended together in one padded call; prefills (a prompt or a chunk of one, possibly after a
cached prefix) one sequence at a time with a causal mask offset by the prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention import cpu_kernel
from pagedllm.attention.kv_quant import QuantizedKVCache
from pagedllm.attention.metadata import AttentionMetadata


def write_kv(kv_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V [T, kvh, hd] at their slots (quantizing them for an int8/fp8 cache)."""
    if isinstance(kv_cache, QuantizedKVCache):
        kv_cache.write(k, v, slot_mapping)
        return
    kernel = cpu_kernel.load() if kv_cache.device.type == "cpu" and k.dtype == kv_cache.dtype else None
    if kernel is not None:
        kernel.write_kv(k, v, kv_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def context_kv(
    kv_cache, block_table: torch.Tensor, context_len: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [context_len, kvh, hd] of positions 0..context_len-1 of one sequence.

    The sequence's blocks are gathered whole, K and V in one index_select, then cut at context_len: a
    gather slot by slot (an index per position, K and V apart) took ~3x as long, and a W32 prefill makes
    ~570 of these a step (every layer of every prompt that continues a cached prefix)."""
    ids = block_table[: (context_len + block_size - 1) // block_size]
    if isinstance(kv_cache, QuantizedKVCache):
        kv = kv_cache.read_blocks(ids, dtype)
    else:
        kv = torch.index_select(kv_cache, 1, ids).to(dtype)
    kv = kv.flatten(1, 2)[:, :context_len]
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, kvh, hd] (already written to the cache)
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Returns [T, H, hd]."""
    nd = meta.num_decodes
    if nd == meta.num_seqs:  # a pure decode step, the common case
        return _decode(q, kv_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], kv_cache, meta, scale)
    bs = meta.block_size
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n, ctx = end - start, meta.seq_lens[i]
        if n == ctx:  # nothing cached before this chunk: attend to the fresh K/V directly
            ks, vs = k[start:end], v[start:end]
        else:
            ks, vs = context_kv(kv_cache, meta.block_tables[i], ctx, bs, q.dtype)
        out[start:end] = _prefill_one(q[start:end], ks, vs, meta.prefix_mask(i, q.dtype), scale)
    return out


def _prefill_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    # [n, H, hd] x [ctx, kvh, hd] -> SDPA layout [1, H, n, hd]; no mask: nothing cached before the chunk
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if mask is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    nd = q.shape[0]
    plain = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == q.dtype
    kernel = cpu_kernel.load() if plain and q.device.type == "cpu" else None
    if kernel is not None:  # reads K/V in place through the block tables: no gathered copy
        return kernel.paged_decode(q, kv_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale)
    return decode_torch(q, kv_cache, meta, scale)


def decode_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The pure-torch decode: gather each context's blocks, then one padded, masked SDPA call."""
    nd = q.shape[0]
    bs = meta.block_size
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    max_len = int(max(meta.seq_lens[:nd]))
    nb = (max_len + bs - 1) // bs
    tables = meta.block_tables[:nd, :nb]
    # gather whole blocks (contiguous block_size x kvh x hd chunks) for K and V in one index_select:
    # about 3x faster on CPU than advanced indexing with the 2-D table
    if isinstance(kv_cache, QuantizedKVCache):
        kv = kv_cache.read_blocks(tables.reshape(-1), q.dtype)
    else:
        kv = torch.index_select(kv_cache, 1, tables.reshape(-1)).to(q.dtype)
    k = kv[0].view(nd, nb * bs, num_kv_heads, head_dim)
    v = kv[1].view(nd, nb * bs, num_kv_heads, head_dim)
    # positions past a sequence's length (padding, block 0 of short tables) are masked out
    valid = torch.arange(nb * bs)[None, :] < meta.seq_lens_tensor[:nd, None]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
