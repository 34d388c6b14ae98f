"""Paged attention in plain torch for the CPU.

K and V live in one cache tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]. No
sequence has a contiguous cache: every read goes through its block table. Decodes (one query each)
are attended together in one padded call; prefills (a prompt or a chunk of one, possibly after a
cached prefix) one sequence at a time with a causal mask offset by the prefix length.

Two variants a layer may ask for: a sliding window (a query at position p sees keys p - window + 1 .. p;
only the blocks holding those are read, since the ones before may have been freed from the block table)
and soft-capped scores (Gemma 2: cap * tanh(score / cap) before the softmax; SDPA has no such hook, so
those layers attend through `_attend`, the plain-torch formula).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.attention.kv_quant import QuantizedKVCache
from pagedllm.attention.metadata import AttentionMetadata


def write_kv(kv_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V [T, kvh, hd] at their slots (quantizing them for an int8/fp8 cache)."""
    if isinstance(kv_cache, QuantizedKVCache):
        kv_cache.write(k, v, slot_mapping)
        return
    kernel = ops.kernel("write_kv") if kv_cache.device.type == "cpu" and k.dtype == kv_cache.dtype else None
    if kernel is not None:
        kernel.write_kv(k, v, kv_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def context_kv(
    kv_cache,
    block_table: torch.Tensor,
    context_len: int,
    block_size: int,
    dtype: torch.dtype,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [context_len - start, kvh, hd] of positions start..context_len-1 of one sequence (start is
    a multiple of block_size: a sliding window's first block).

    The sequence's blocks are gathered whole, K and V in one index_select, then cut at context_len: a
    gather slot by slot (an index per position, K and V apart) took ~3x as long, and a W32 prefill makes
    ~570 of these a step (every layer of every prompt that continues a cached prefix)."""
    ids = block_table[start // block_size : (context_len + block_size - 1) // block_size]
    if isinstance(kv_cache, QuantizedKVCache):
        kv = kv_cache.read_blocks(ids, dtype)
    else:
        kv = torch.index_select(kv_cache, 1, ids).to(dtype)
    kv = kv.flatten(1, 2)[:, : context_len - start]
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, kvh, hd] (already written to the cache)
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Returns [T, H, hd]. window: sliding-window attention; softcap: soft-capped scores (module docstring)."""
    nd = meta.num_decodes
    if nd == meta.num_seqs:  # a pure decode step, the common case
        return _decode(q, kv_cache, meta, scale, window, softcap)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], kv_cache, meta, scale, window, softcap)
    bs = meta.block_size
    eager = softcap is not None or ops.backend("attention_prefill") == ops.REFERENCE
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n, ctx = end - start, meta.seq_lens[i]
        if n == ctx:  # nothing cached before this chunk: attend to the fresh K/V directly
            ks, vs = k[start:end], v[start:end]
        else:
            first = meta.window_start(i, window)
            ks, vs = context_kv(kv_cache, meta.block_tables[i], ctx, bs, q.dtype, first)
        mask = meta.prefix_mask(i, q.dtype, window)
        if eager:  # soft-capped scores have no SDPA hook; the eager formula is also the reference
            out[start:end] = _attend(q[start:end], ks, vs, mask, scale, softcap)
        else:
            out[start:end] = _prefill_one(q[start:end], ks, vs, mask, scale)
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


def _attend(
    q: torch.Tensor,  # [n, H, hd]
    k: torch.Tensor,  # [m, kvh, hd]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [n, m] additive, or [B, 1, n, m] with q [B, n, H, hd]; None = causal
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention as transformers' eager attention computes it: scores in the inputs' dtype, the soft cap
    (if any), the mask, a float32 softmax cast back, then the weighted sum. attention_prefill's reference."""
    batched = q.dim() == 4
    if not batched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)  # [B, H, n, hd]
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, m = scores.shape[-2:]
        mask = torch.zeros(n, m, dtype=scores.dtype).masked_fill_(
            torch.ones(n, m, dtype=torch.bool).triu_(m - n + 1), float("-inf")
        )
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(probs, vh).transpose(1, 2)  # [B, n, H, hd]
    return o if batched else o.squeeze(0)


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    nd = q.shape[0]
    plain = isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == q.dtype
    kernel = ops.kernel("attention_decode") if plain and q.device.type == "cpu" else None
    if kernel is not None:  # reads K/V in place through the block tables: no gathered copy
        return kernel.paged_decode(
            q, kv_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd], scale, window or 0, softcap or 0.0
        )
    return decode_torch(q, kv_cache, meta, scale, window, softcap)


def decode_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The pure-torch decode: gather each context's blocks (from the window's first block, with a
    window), then one padded, masked SDPA call (or `_attend`, soft-capped)."""
    nd = q.shape[0]
    bs = meta.block_size
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    lens = meta.seq_lens_tensor[:nd]
    # each row's first block: blocks before a window may no longer be the request's
    first = (lens - window).clamp_(min=0) // bs if window else torch.zeros_like(lens)
    nb = int(((lens + bs - 1) // bs - first).max())
    cols = first[:, None] + torch.arange(nb)[None, :]  # block columns read, past a row's end clamped
    tables = meta.block_tables[:nd].gather(1, cols.clamp_(max=meta.block_tables.shape[1] - 1))
    # gather whole blocks (contiguous block_size x kvh x hd chunks) for K and V in one index_select:
    # about 3x faster on CPU than advanced indexing with the 2-D table
    if isinstance(kv_cache, QuantizedKVCache):
        kv = kv_cache.read_blocks(tables.reshape(-1), q.dtype)
    else:
        kv = torch.index_select(kv_cache, 1, tables.reshape(-1)).to(q.dtype)
    k = kv[0].view(nd, nb * bs, num_kv_heads, head_dim)
    v = kv[1].view(nd, nb * bs, num_kv_heads, head_dim)
    # positions past a sequence's length (padding, repeated last blocks) and before its window are masked
    pos = first[:, None] * bs + torch.arange(nb * bs)[None, :]
    valid = pos < lens[:, None]
    if window:
        valid &= pos >= lens[:, None] - window
    if softcap is not None:
        mask = torch.zeros(valid.shape, dtype=q.dtype).masked_fill_(~valid, float("-inf"))
        return _attend(q.unsqueeze(1), k, v, mask[:, None, None, :], scale, softcap).squeeze(1)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
