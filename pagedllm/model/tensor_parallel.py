"""Cut a loaded model down to one tensor-parallel rank's share, in place, before fuse_for_inference
(build.load_model_for_inference runs the two in that order).

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (each rank keeps the output rows
of its heads and of its part of the intermediate size), o and down are row-parallel (each keeps the
matching input columns and the model all-reduces their partial products: llama.py), the embedding and the
lm_head are split by vocabulary, norms are whole on every rank. A MoE layer's experts are each cut like
a dense MLP (their slice of moe_intermediate_size) and its router is whole, so every rank routes alike.
Which heads a rank gets is distributed/partition.py's rule. Quantized layers (int8/int4 RTN, GPTQ/AWQ
folders, GGUF blocks) are cut on their group boundaries from their codes, scales and mins, so every rank
computes exactly the products the whole layer would, only over fewer rows or columns.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import all_reduce
from pagedllm.distributed.partition import head_shards, split
from pagedllm.errors import InputError
from pagedllm.quantization.linear import QuantLinear


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding: a token outside them looks up zeros, and the all-reduce sums
    the one rank that holds it with everyone's zeros."""

    def __init__(self, weight: torch.Tensor, start: int, end: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end = start, end

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(x)


def _cut(
    layer: nn.Module, rows: tuple[int, int] | None, cols: tuple[int, int] | None, keep_bias: bool, name: str
):
    """The layer restricted to output rows `rows` and input columns `cols` (None: all)."""
    if isinstance(layer, QuantLinear):
        codes = layer.codes()
        scales, mins = layer.scales_and_mins()
        group = layer.group_size
        if cols is not None:
            a, b = cols
            if group is not None:
                if a % group or (b % group and b != layer.in_features):
                    raise InputError(
                        f"{name}: its input split at {a}..{b} does not fall on its quantization groups of "
                        f"{group}; choose another tensor_parallel_size",
                        param="tensor_parallel_size",
                    )
                scales, mins = scales[:, a // group : -(-b // group)], mins[:, a // group : -(-b // group)]
            codes = codes[:, a:b]
        bias = layer.bias if keep_bias else None
        if rows is not None:
            a, b = rows
            codes, scales, mins = codes[a:b], scales[a:b], mins[a:b]
            bias = None if bias is None else bias[a:b]
        return QuantLinear.from_codes(
            codes.contiguous(), scales.contiguous(), mins.contiguous(), layer.bits, group, bias, layer.name
        )
    if type(layer) is not nn.Linear:
        raise InputError(
            f"{name}: tensor parallelism cannot split a {type(layer).__name__}", "tensor_parallel_size"
        )
    weight = layer.weight.detach()
    bias = layer.bias.detach() if layer.bias is not None and keep_bias else None
    if cols is not None:
        weight = weight[:, cols[0] : cols[1]]
    if rows is not None:
        weight = weight[rows[0] : rows[1]]
        bias = None if bias is None else bias[rows[0] : rows[1]]
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return out


def check_shardable(config: ModelConfig, tp_size: int) -> None:
    """Refuse a model feature the split does not implement (the engine asks before starting workers)."""
    if tp_size > 1 and config.qk_norm_full:
        # the norm's mean runs over every head's q, which no rank holds whole: it would need a collective
        raise InputError(
            f"tensor_parallel_size {tp_size}: {config.architecture}'s q/k norm over the whole projection "
            "(OLMoE) is not implemented under tensor parallelism; use tensor_parallel_size 1",
            param="tensor_parallel_size",
        )


def _group_of(layer: nn.Module) -> int:
    return getattr(layer, "group_size", None) or 1


def shard_model(model: nn.Module, config: ModelConfig, rank: int, tp_size: int) -> ModelConfig:
    """Keep rank `rank`'s share of `model` (in place); returns its local config (the heads it holds),
    which sizes its KV cache."""
    check_shardable(config, tp_size)
    shard = head_shards(config.num_heads, config.num_kv_heads, tp_size)[rank]
    hd = config.head_dim
    q_rows = (shard.q_start * hd, shard.q_end * hd)
    kv_rows = (shard.kv_start * hd, shard.kv_end * hd)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or getattr(mlp, "gate_up_proj", None) is not None:
            raise RuntimeError("shard_model runs before fuse_for_inference")
        prefix = f"model.layers.{i}"
        attn.q_proj = _cut(attn.q_proj, q_rows, None, True, f"{prefix}.self_attn.q_proj")
        attn.k_proj = _cut(attn.k_proj, kv_rows, None, True, f"{prefix}.self_attn.k_proj")
        attn.v_proj = _cut(attn.v_proj, kv_rows, None, True, f"{prefix}.self_attn.v_proj")
        # row-parallel: the bias is added once, by rank 0, so the all-reduce counts it once
        attn.o_proj = _cut(attn.o_proj, None, q_rows, rank == 0, f"{prefix}.self_attn.o_proj")
        attn.num_heads, attn.num_kv_heads = shard.num_heads, shard.num_kv_heads
        attn.qkv_sizes = (shard.num_heads * hd, *(2 * [shard.num_kv_heads * hd]))
        if hasattr(mlp, "experts"):  # MoE: the router stays whole
            for j, expert in enumerate(mlp.experts):
                _shard_mlp(expert, config.moe_intermediate_size, rank, tp_size, f"{prefix}.mlp.experts.{j}")
        else:
            _shard_mlp(mlp, config.intermediate_size, rank, tp_size, f"{prefix}.mlp")

    # the vocabulary in equal parts (the last one padded with zero rows): the gathered logits are then
    # every rank's in order, cut back to vocab_size (compute_logits)
    vocab = config.vocab_size
    per_rank = -(-vocab // tp_size)
    start, end = min(vocab, rank * per_rank), min(vocab, (rank + 1) * per_rank)
    embed = model.model.embed_tokens
    # a QuantEmbedding (a GGUF's rows looked up from blocks) is cut as floats: TP serves big models on many
    # sockets, where the table's float copy matters less than on one
    weight = embed.weight.detach() if hasattr(embed, "weight") else embed.dequantize_weight()
    tied = type(model.lm_head) is nn.Linear and model.lm_head.weight is getattr(embed, "weight", None)
    model.model.embed_tokens = VocabParallelEmbedding(weight[start:end].contiguous(), start, end)
    if tied and end - start == per_rank:
        model.lm_head = nn.Linear(config.hidden_size, per_rank, bias=False, device="meta")
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        head = _cut(model.lm_head, (start, end), None, True, "lm_head")
        if end - start < per_rank:
            head = _pad_rows(head, per_rank)
        model.lm_head = head
    model.tp_vocab_size = vocab  # compute_logits cuts the gathered logits back to it
    return dataclasses.replace(config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads)


def _shard_mlp(mlp: nn.Module, width: int, rank: int, tp_size: int, prefix: str) -> None:
    """gate/up column-parallel and down row-parallel over the rank's slice of `width`."""
    f = split(width, tp_size, _group_of(mlp.down_proj))[rank]
    mlp.gate_proj = _cut(mlp.gate_proj, f, None, True, f"{prefix}.gate_proj")
    mlp.up_proj = _cut(mlp.up_proj, f, None, True, f"{prefix}.up_proj")
    mlp.down_proj = _cut(mlp.down_proj, None, f, rank == 0, f"{prefix}.down_proj")


def _pad_rows(layer: nn.Module, rows: int) -> nn.Module:
    """The layer with zero output rows appended up to `rows` (their logits are cut off after the gather)."""
    if isinstance(layer, QuantLinear):
        codes = layer.codes()
        scales, mins = layer.scales_and_mins()
        extra = rows - codes.shape[0]
        return QuantLinear.from_codes(
            torch.cat([codes, codes.new_zeros(extra, codes.shape[1])]),
            torch.cat([scales, scales.new_zeros(extra, scales.shape[1])]),
            torch.cat([mins, mins.new_zeros(extra, mins.shape[1])]),
            layer.bits,
            layer.group_size,
            None,
            layer.name,
        )
    weight = layer.weight.detach()
    out = nn.Linear(weight.shape[1], rows, bias=False, device="meta")
    out.weight = nn.Parameter(torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])]))
    return out
