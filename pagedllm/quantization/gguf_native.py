"""Serve GGUF Q4_0 / Q4_1 / Q8_0 linear weights as stored: their blocks become QuantLinear codes + scales.

A block covers 32 weights along the input dimension with an fp16 scale d (and, for Q4_1, an fp16 min m):
    Q4_0  18 bytes: d, 16 bytes of nibbles   w = d * (q - 8)   -> scales = d, mins = -8 d
    Q4_1  20 bytes: d, m, 16 bytes           w = d * q + m     -> scales = d, mins = m
    Q8_0  34 bytes: d, 32 int8               w = d * q         -> codes q + 128, scales = d, mins = -128 d
Nibbles: byte j of a block holds weight j (low) and weight j + 16 (high), unlike pack.py's neighbours.
In float32, s*q + m above is the same arithmetic gguf.quants.dequantize does (d*q and 8d, 128d are exact
for an fp16 d), so QuantLinear.dequantize_weight() equals it bit for bit.

What runs where (bf16 activations): Q4_0/Q4_1 are group-32 INT4, so up to KERNEL_MAX_ROWS rows they run
on the INT4 kernel, whose bf16 scale/zero round d (fp16, 11 bits) to 8 bits: bf16-level differences, the
same size as storing the dequantized weight in bf16. Q8_0 has a scale per 32 weights and the INT8 kernel
only one per channel, so Q8_0 linears take the dequantize path every call, unless the AMX kernel
(quantization/amx.py) serves them, which takes group-wise 4- and 8-bit codes alike and runs every Q4/Q8
linear above a few rows. Other types (Q4_K, Q6_K, ...) stay dequantized floats, as does the token_embd
lookup; the lm_head (token_embd when tied) is served from its blocks only when AMX takes it.

llama.cpp stores the rows of attn_q / attn_k permuted; rows are whole here (codes, scales and mins of a row
move together), so unpermuting them is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.gguf_layout import unpermute_qk
from pagedllm.model.loader import registry
from pagedllm.quantization.linear import QuantLinear

BLOCK = 32
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def decode_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, ...]):
    """Raw rows of blocks -> (codes uint8 [out, in], scales f32 [out, in/32], mins f32 [out, in/32], bits)."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, _BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        codes = q.astype(np.uint8)
        mins = -128 * d
        bits = 8
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # weights 0..15 then 16..31
        mins = (
            blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            if type_name == "Q4_1"
            else -8 * d
        )
        bits = 4
    return (
        torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols))),
        torch.from_numpy(np.ascontiguousarray(d)),
        torch.from_numpy(np.ascontiguousarray(mins.astype(np.float32))),
        bits,
    )


def gguf_quant_linear(
    name: str,
    type_name: str,
    raw: np.ndarray,
    shape: tuple[int, ...],
    config: ModelConfig,
    bias: torch.Tensor | None = None,
) -> QuantLinear:
    """One HF-named linear (e.g. model.layers.0.self_attn.q_proj) from its raw GGUF blocks."""
    codes, scales, mins, bits = decode_blocks(type_name, raw, shape)
    if registry.get(config.architecture).gguf_permuted_qk and (".q_proj" in name or ".k_proj" in name):
        heads = config.num_heads if ".q_proj" in name else config.num_kv_heads
        codes, scales, mins = (
            torch.from_numpy(unpermute_qk(t.numpy(), heads).copy()) for t in (codes, scales, mins)
        )
    return QuantLinear.from_codes(codes, scales, mins, bits, BLOCK, bias, name)


def serve_gguf_natively(
    model: torch.nn.Module,
    gguf_tensors: dict[str, tuple[str, np.ndarray, tuple[int, ...]]],
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
) -> list[str]:
    """Replace the model's linears whose GGUF type is Q4_0/Q4_1/Q8_0; returns their names."""
    from pagedllm.quantization.model import linear_layer_names, set_module

    replaced = []
    for name in linear_layer_names(model):
        entry = gguf_tensors.get(name + ".weight")
        if entry is None or entry[0] not in NATIVE_TYPES:
            continue
        type_name, raw, shape = entry
        old = model.get_submodule(name)
        layer = gguf_quant_linear(name, type_name, raw, shape, config, old.bias)
        layer.pack(dtype)
        set_module(model, name, layer)
        replaced.append(name)
    # The lm_head (a tied one is token_embd, Q8_0 in the default model) from its blocks too, as llama.cpp
    # does, but only where a kernel takes it: the dequantize path would rebuild 28M weights every step.
    # Its AMX bf16 tiles equal the dequantized checkpoint's bf16 lm_head; only the summation order differs.
    entry = gguf_tensors.get("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    if entry is not None and entry[0] in NATIVE_TYPES:
        type_name, raw, shape = entry
        head = gguf_quant_linear("lm_head", type_name, raw, shape, config)
        head.pack(dtype)
        if head.kernel is not None and not head.kernel.dequantizes_at(head, 32):
            model.lm_head = head
            replaced.append("lm_head")
    return replaced
