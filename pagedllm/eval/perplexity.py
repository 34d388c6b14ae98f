"""Perplexity by the GPTQ protocol, through the engine's real paged path.

Join the text, tokenize it once, cut the ids into non-overlapping windows of `ctx` tokens (the tail that
does not fill a window is dropped), run each window from an empty context, and take the mean
cross-entropy of every predicted token (ctx - 1 per window) over all windows: ppl = exp(mean CE).
Each window is a fresh sequence in a paged KV cache, exactly as a prompt prefill is in the engine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pagedllm.attention.kv_quant import KV_QUANT_DTYPES, QuantizedKVCache, resolve_kv_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.errors import InputError

# torch dtypes the paged attention can already store K/V in (it casts on write and on read).


@dataclass
class PerplexityResult:
    ppl: float  # exp(nll)
    nll: float  # mean cross-entropy per predicted token, in nats
    num_tokens: int  # predicted tokens: num_windows * (ctx - 1)
    num_windows: int
    ctx: int

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity_windows(token_ids, ctx: int, max_windows: int | None = None) -> torch.Tensor:
    """The protocol's windows: [num_windows, ctx], non-overlapping, tail dropped."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2:
        raise InputError(f"ctx must be a whole number >= 2, got {ctx!r}", param="ctx")
    if max_windows is not None and (isinstance(max_windows, bool) or max_windows < 1):
        raise InputError(f"max_windows must be >= 1, got {max_windows!r}", param="max_windows")
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    n = ids.numel() // ctx
    if n == 0:
        raise InputError(
            f"the text has {ids.numel()} tokens, fewer than one window of ctx={ctx}", param="ctx"
        )
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * ctx].view(n, ctx)


def _batch_metadata(num_seqs: int, ctx: int, start: int, end: int, block_size: int) -> AttentionMetadata:
    """num_seqs sequences, each owning its own run of blocks, computing positions start..end-1."""
    blocks_per_seq = -(-ctx // block_size)
    n = end - start
    tables = torch.arange(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq)
    pos = torch.arange(start, end)
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, n]
    return AttentionMetadata(
        slot_mapping=slots.reshape(-1),
        query_start_loc=[i * n for i in range(num_seqs + 1)],
        seq_lens=[end] * num_seqs,
        block_tables=tables,
        num_decodes=num_seqs if n == 1 else 0,
        seq_lens_tensor=torch.full((num_seqs,), end),
        block_size=block_size,
    )


def window_nll(
    model,
    windows: torch.Tensor,
    kv_cache_dtype: torch.dtype | None = None,
    block_size: int = 16,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of each window [B, ctx] -> [B], all windows in one flat batch.

    With chunk_size the windows are prefilled chunk by chunk, so later chunks read K/V back from the
    cache (the only way its dtype matters: a whole-window prefill attends to the fresh K/V).
    """
    cfg = model.config
    num_seqs, ctx = windows.shape
    dtype = next(model.parameters()).dtype
    num_blocks = num_seqs * -(-ctx // block_size)
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if kv_cache_dtype in KV_QUANT_DTYPES:  # "int8" / "fp8": codes with per-token, per-head scales
        caches = [QuantizedKVCache.zeros(kv_cache_dtype, *shape) for _ in range(cfg.num_layers)]
    else:
        caches = [torch.zeros(2, *shape, dtype=kv_cache_dtype or dtype) for _ in range(cfg.num_layers)]
    chunk = chunk_size or ctx
    total = torch.zeros(num_seqs, dtype=torch.float64)
    for start in range(0, ctx, chunk):
        end = min(ctx, start + chunk)
        meta = _batch_metadata(num_seqs, ctx, start, end, block_size)
        ids = windows[:, start:end]
        pos = torch.arange(start, end).repeat(num_seqs)
        hidden = model(ids.reshape(-1), pos, caches, meta).view(num_seqs, end - start, -1)
        # position p predicts token p + 1; the window's last position predicts nothing
        last = end if end < ctx else ctx - 1
        targets = windows[:, start + 1 : last + 1]
        logits = model.compute_logits(hidden[:, : last - start].reshape(-1, hidden.shape[-1]))
        ce = F.cross_entropy(logits.float(), targets.reshape(-1), reduction="none")
        total += ce.view(num_seqs, last - start).double().sum(1)
    return total


def perplexity(
    model,
    token_ids,
    ctx: int = 512,
    batch_size: int = 1,
    max_windows: int | None = None,
    kv_cache_dtype: str | torch.dtype | None = None,
    chunk_size: int | None = None,
    show_progress: bool = True,
) -> PerplexityResult:
    """Perplexity of `model` (a LlamaForCausalLM) on token_ids, GPTQ protocol with windows of ctx tokens.

    batch_size windows go through the model together (one flat batch of sequences). kv_cache_dtype
    ("auto", "fp32", "fp16", "bf16", a torch dtype, or "int8" / "fp8" for a quantized cache) is the element
    type of the paged cache. It only changes results together with chunk_size (see window_nll).
    """
    if ctx > model.config.max_position_embeddings:
        raise InputError(
            f"ctx {ctx} exceeds the model's max_position_embeddings {model.config.max_position_embeddings}",
            param="ctx",
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a whole number >= 1, got {batch_size!r}", param="batch_size")
    if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size < 1):
        raise InputError(f"chunk_size must be >= 1, got {chunk_size!r}", param="chunk_size")
    if isinstance(kv_cache_dtype, str):
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    windows = perplexity_windows(token_ids, ctx, max_windows)
    total, n = 0.0, windows.shape[0]
    with tqdm(total=n, desc=f"perplexity ctx={ctx}", unit="window", disable=not show_progress) as bar:
        for b in range(0, n, batch_size):
            batch = windows[b : b + batch_size]
            total += window_nll(model, batch, kv_cache_dtype, chunk_size=chunk_size).sum().item()
            bar.update(batch.shape[0])
            bar.set_postfix(ppl=f"{math.exp(total / ((b + batch.shape[0]) * (ctx - 1))):.3f}")
    num_tokens = n * (ctx - 1)
    nll = total / num_tokens
    return PerplexityResult(ppl=math.exp(nll), nll=nll, num_tokens=num_tokens, num_windows=n, ctx=ctx)


def read_text_ids(path, tokenizer) -> list[int]:
    """The whole file as one string, tokenized once without special tokens (the protocol's join)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"text file {p} does not exist", param="text")
    return tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False)
