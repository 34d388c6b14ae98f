"""A pooling model: a model definition (the encoder, or a registry decoder) + its Pooler, and a
cross-encoder's head and activation. It takes whole inputs as one flat batch and keeps nothing after it.

The decoder runs as it does for generation (model/llama.py, its layer loop) over a scratch KV cache that
lives for one forward: every input is a fresh prefill, so its attention reads the new K/V directly and the
cache only receives the writes. The cache is shared by all layers (each layer's writes are read by no one),
so it costs one layer's K/V for the batch, not the model's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.errors import InputError
from pagedllm.model.classes import model_class
from pagedllm.model.encoder import EncoderBatch, EncoderModel, read_encoder_config
from pagedllm.model.loader.hf_config import check_complete, read_hf_config, split_fused
from pagedllm.model.loader.sentence_transformers import PoolingSpec
from pagedllm.model.pooling import ACTIVATIONS, Pooler
from pagedllm.model.quantized_checkpoint import _read_tensors as read_tensors

SCRATCH_BLOCK_SIZE = 16


class PoolingModel:
    def __init__(self, spec: PoolingSpec, dtype: torch.dtype):
        self.spec = spec
        self.pooler = Pooler(spec.pooling_type, spec.normalize)
        self.activation = ACTIVATIONS.get(spec.activation) if spec.activation else None
        if spec.activation and self.activation is None:
            raise InputError(
                f"cross-encoder activation {spec.activation!r} is not supported ({', '.join(ACTIVATIONS)})",
                param="model",
            )
        # as stored (bf16 or fp32): from_weights copies each into its parameter in the model's dtype
        weights = read_tensors(spec.model_folder)
        if spec.encoder:
            self.encoder_config = config = read_encoder_config(spec.model_folder)
            self.model = EncoderModel.from_weights(config, weights, dtype)
            self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
            self.max_position = config.max_model_len
        else:
            config = read_hf_config(spec.model_folder)
            weights = {n if n.startswith("model.") else f"model.{n}": t for n, t in weights.items()}
            weights.pop("model.lm_head.weight", None)
            weights.pop("lm_head.weight", None)
            config = replace(config, tie_word_embeddings=True)  # no lm_head: the hidden states are the output
            split_fused(weights, config, spec.model_folder)
            check_complete(weights, config, spec.model_folder)
            self.model = model_class(config).from_weights(config, weights, dtype)
            self.decoder_config = config
            self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
            self.max_position = config.max_position_embeddings
        self.dtype = dtype
        if spec.task == "score" and (not spec.encoder or self.model.classifier is None):
            raise InputError(f"{spec.model_folder}: a cross-encoder needs a classifier head", "model")

    @property
    def max_model_len(self) -> int:
        return min(self.spec.max_model_len or self.max_position, self.max_position)

    def hidden_states(self, inputs: list[list[int]], token_types: list[list[int] | None]) -> torch.Tensor:
        """[T, hidden] for the flat batch of `inputs` (token ids; token type ids for an encoder's pairs)."""
        if self.spec.encoder:
            return self.model(EncoderBatch.build(inputs, token_types))
        return _decoder_forward(self.model, self.decoder_config, inputs)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """[B, hidden] float32 pooled (and, if the model does, normalized) vectors."""
        return self.pooler(self.hidden_states(inputs, [None] * len(inputs)), [len(i) for i in inputs])

    @torch.inference_mode()
    def score(self, inputs: list[list[int]], token_types: list[list[int] | None]) -> torch.Tensor:
        """[B, num_labels] float32: the classifier's logits through CrossEncoder.predict's activation."""
        hidden = self.hidden_states(inputs, token_types)
        return self.activation(self.model.classify(hidden, [len(i) for i in inputs]))


def _decoder_forward(model, config, inputs: list[list[int]]) -> torch.Tensor:
    """The decoder's final hidden states for whole inputs, each a fresh prefill, over a scratch cache."""
    bs = SCRATCH_BLOCK_SIZE
    lens = [len(ids) for ids in inputs]
    blocks = [-(-n // bs) for n in lens]
    first = torch.tensor([0, *blocks[:-1]]).cumsum(0)
    table = torch.zeros(len(inputs), max(blocks), dtype=torch.long)
    for i, (start, n) in enumerate(zip(first.tolist(), blocks)):
        table[i, :n] = torch.arange(start, start + n)
    positions = torch.cat([torch.arange(n) for n in lens])
    owner = torch.arange(len(inputs)).repeat_interleave(torch.tensor(lens))
    slots = first[owner] * bs + positions
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    meta = AttentionMetadata(slots, starts, lens, table, 0, torch.tensor(lens), bs)
    cache = torch.zeros((2, sum(blocks), bs, config.num_kv_heads, config.head_dim), dtype=model.dtype)
    ids = torch.tensor([t for seq in inputs for t in seq], dtype=torch.long)
    return model(ids, positions, [cache] * config.num_layers, meta)
