"""QuantEmbedding: the token embedding looked up from quantized rows, as llama.cpp's get_rows does.

A GGUF file's token_embd is quantized like its linears (Q6_K in a Q4_K_M file, Q8_0 in the default model);
dequantizing all of it at load costs vocab x hidden floats (a 1B Llama-3 shape's 49152 x 2048: 400 MB in
float32 while it loads, 200 MB of bf16 after) for a table a step reads a few rows of. Here the table stays a
QuantLinear [vocab, hidden] and a step dequantizes only the rows of its tokens (QuantLinear.rows: s * q + m
in float32, rounded once to the model's dtype), which is exactly what the float embedding held.

With tied embeddings the table is the lm_head itself (one copy of the blocks serves both) where its kernel
can give rows back cheaply (the AVX2 layout, or the stored form); otherwise the embedding keeps the stored
form of its own (QuantLinear.stored_copy: still ~1/2 to 1/4 the bytes of a bf16 table).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.linear import QuantLinear


class QuantEmbedding(nn.Module):
    def __init__(self, table: QuantLinear, dtype: torch.dtype):
        super().__init__()
        if not table.gives_rows_cheaply():
            table = table.stored_copy()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = self.table.rows(ids).to(self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def dequantize_weight(self) -> torch.Tensor:
        """The whole table in the model's dtype (what tensor parallelism cuts)."""
        return self.table.dequantize_weight(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, from quantized rows"
