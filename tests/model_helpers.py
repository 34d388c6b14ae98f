"""Run our model on one sequence through the real paged path, for comparisons with HF transformers."""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata


def paged_prefill_logits(
    model, token_ids: list[int], block_size: int = 16, chunk: int | None = None
) -> torch.Tensor:
    """Logits for every position of token_ids, computed in chunks over a scattered block table."""
    cfg = model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    # a reversed, gapped block table: nothing may assume contiguous blocks
    table = [2 * (num_blocks - i) for i in range(num_blocks)]
    dtype = next(model.parameters()).dtype
    caches = [
        torch.zeros(2, 2 * num_blocks + 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        for _ in range(cfg.num_layers)
    ]
    chunk = chunk or n
    logits = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pos = torch.arange(start, end)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=[0, end - start],
            seq_lens=[end],
            block_tables=torch.tensor([table]),
            num_decodes=1 if end - start == 1 else 0,
            seq_lens_tensor=torch.tensor([end]),
            block_size=block_size,
        )
        hidden = model(torch.tensor(token_ids[start:end]), pos, caches, meta)
        logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def exact_llm(**kwargs):
    """The default model as an LLM in fp32 with the GGUF dequantized, so that batch composition, chunking,
    a cached prefix or a recompute after preemption (attention summed in another order, ~1e-7) cannot change
    a greedy token. The GGUF-native default rounds activations to int8 per 32 inputs, which turns such
    differences into whole rounding steps now and then, so there the same holds only away from near ties
    (as in llama.cpp)."""
    from pagedllm import LLM

    return LLM(model="default", dtype="fp32", quantization="none", show_progress=False, **kwargs)
