"""All decoder layers of a small decode step in one C++ call (csrc/decode_stack.cpp).

For 1-4 sequences decoding one token each, a step of a model whose linears are quantized in the AMX
layout (quantization/linear.py) costs more in the Python and dispatch around its ~12 calls a layer than
in their arithmetic. The C++ stack makes the same calls on the same tensors (the functions the Python
path binds), so its hidden states equal the Python path's bit for bit. Built by fuse.py when every
decoder linear qualifies; the model falls back to its layer loop for anything else (prefills, larger
batches, a quantized KV cache).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpp_extension import load_cpp_extension
from pagedllm.quantization import amx
from pagedllm.quantization.linear import QuantLinear

SOURCE = Path(__file__).parent / "csrc" / "decode_stack.cpp"


@cache
def load():
    return load_cpp_extension("pagedllm_decode_stack", SOURCE)


def _linear_parts(layer) -> tuple[list[torch.Tensor], list[int]] | None:
    if not isinstance(layer, QuantLinear) or not layer._amx:
        return None
    bias = layer.bias.to(torch.bfloat16) if layer.bias is not None else torch.empty(0)  # as forward() rounds it
    return [*layer._amx, bias], [layer.bits, layer.group_size or layer.in_features, layer.out_features]


def build_decode_stack(model):
    """The C++ stack over `model`'s decoder layers, or None where it does not apply: a linear that is not
    quantized in the AMX layout (bf16 models, CPUs without AMX), activations other than bf16, or no
    compiler."""
    if model.model.embed_tokens.weight.dtype != torch.bfloat16 or amx.load() is None:
        return None
    tensors: list[torch.Tensor] = []
    shapes: list[int] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.bfloat16 for w in norms):
            return None
        tensors += [w.detach() for w in norms]
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts = _linear_parts(linear)
            if parts is None:
                return None
            tensors += parts[0]
            shapes += parts[1]
    ext = load()
    if ext is None:
        return None
    attn = model.model.layers[0].self_attn
    eps = model.model.layers[0].input_layernorm.eps
    return ext.DecodeStack(tensors, shapes, attn.num_heads, attn.num_kv_heads, attn.head_dim, eps, attn.scale)


def applies(meta: AttentionMetadata, x: torch.Tensor, kv_caches: list) -> bool:
    """Whether this step is one the stack runs: decodes only, 1-4 of them, a plain (unquantized) cache."""
    return (
        meta.num_decodes == meta.num_seqs
        and 1 <= x.shape[0] <= amx.GEMV_MAX_ROWS
        and isinstance(kv_caches[0], torch.Tensor)
        and kv_caches[0].dtype == x.dtype
    )
