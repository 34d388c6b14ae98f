"""Pooling: from a model's per-token hidden states to one vector (an embedding) or one score per input.

A pooling model is a model definition that gives hidden states for a flat batch of whole inputs (the
encoder, model/encoder.py, or a registry decoder, model/llama.py, run over a scratch KV cache that is
dropped after the forward), a Pooler, and for a cross-encoder its classifier head and the activation
sentence-transformers' CrossEncoder.predict applies. vLLM's pooler (vllm/model_executor/layers/pooler.py)
is the model: the pooling type comes from the sentence-transformers folder, or the family's default.

    cls        the first token (BERT / XLM-R's [CLS] / <s>)
    mean       the average over every token of the input (its special tokens too, as sentence-transformers)
    max        the element-wise maximum over the tokens
    lasttoken  the last token (a decoder's: the only one that has seen the whole input)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_TYPES = ("cls", "mean", "max", "lasttoken")
# CrossEncoder.predict's activation on the logits, by config.json's sentence_transformers.activation_fn
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": torch.tanh,
}


@dataclass(frozen=True)
class Pooler:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # L2-normalize the pooled vector (sentence-transformers' Normalize module)

    def __call__(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """[T, d] hidden states of a flat batch -> [B, d] float32 pooled vectors, one per input."""
        hidden = hidden.float()
        lens = torch.tensor(seq_lens)
        ends = lens.cumsum(0)
        if self.pooling_type == "cls":
            pooled = hidden.index_select(0, ends - lens)
        elif self.pooling_type == "lasttoken":
            pooled = hidden.index_select(0, ends - 1)
        elif self.pooling_type == "mean":
            owner = torch.arange(len(seq_lens)).repeat_interleave(lens)
            sums = hidden.new_zeros(len(seq_lens), hidden.shape[1]).index_add_(0, owner, hidden)
            pooled = sums / lens[:, None].to(hidden.dtype)
        else:  # max
            pooled = torch.stack([part.amax(0) for part in hidden.split(seq_lens)])
        return F.normalize(pooled, dim=-1) if self.normalize else pooled


def truncate_dimensions(vectors: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Matryoshka: the first `dimensions` values, renormalized where the model normalizes (vLLM's rule)."""
    out = vectors[..., :dimensions]
    return F.normalize(out, dim=-1) if normalize else out
