"""All decoder layers of a step in one C++ call (csrc/decode_stack.cpp).

A single-stream decode step of a model whose linears are quantized in the AMX layout
(quantization/linear.py) or prepacked bf16 (model/layers/packed_linear.py) on the amx tier, or quantized in
the AVX2 layout (quantization/avx2.py, float32 or bf16 activations) on every tier from avx2 up, costs more
in the Python and dispatch around its ~12 calls a layer than in their arithmetic. The C++ stack makes the same calls on the
same tensors (the functions the Python path binds, the same ATen and oneDNN ops), so its hidden states
equal the Python path's bit for bit. It runs the steps that are all decodes (any number) and the
prefill of one prompt with nothing cached before it (a request's first token); built by fuse.py when
every decoder linear qualifies. Everything else (mixed or chunked steps, several prefills, a quantized
KV cache) takes the model's layer loop.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedllm import kernels
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model.layers.packed_linear import PackedLinear
from pagedllm.quantization.linear import QuantLinear

SOURCE = Path(__file__).parent / "csrc" / "decode_stack.cpp"
logger = logging.getLogger("pagedllm")


def load():
    # built for this process's tier from avx2 up: the amx tier's build also takes AMX-layout linears
    # (woq_amx.h; ext.amx is True), the others AVX2-layout and prepacked ones; below avx2 the model's
    # per-op path runs
    return kernels.load("decode_stack")


# csrc/decode_stack.cpp's LinearKind
_PACKED, _AMX, _AVX2 = 0, 1, 2


def _linear_parts(layer, dtype: torch.dtype, amx_build: bool) -> tuple[list[torch.Tensor], list[int]] | None:
    """What the C++ Linear holds (csrc/decode_stack.cpp) for the kernel the layer itself picks for `dtype`
    activations: (kind, bits, group_size, out_features) and four tensors, or None where the stack cannot
    make that call."""
    empty = torch.empty(0)
    if isinstance(layer, PackedLinear):
        if dtype != torch.bfloat16:
            return None
        bias = layer.bias if layer.bias is not None else empty
        return [layer.packed_weight, empty, empty, bias], [_PACKED, 0, 0, layer.out_features]
    if not isinstance(layer, QuantLinear):
        return None
    group = layer.group_size or layer.in_features
    if dtype == torch.bfloat16 and layer._amx and amx_build:
        bias = layer.bias.to(torch.bfloat16) if layer.bias is not None else empty  # as forward() rounds it
        return [*layer._amx, bias], [_AMX, layer.bits, group, layer.out_features]
    # the AVX2 kernel serves every row count, so one row's path is every step's
    if layer._avx2 and layer.path(1, dtype) == "avx2":
        bias = layer.bias.float() if layer.bias is not None else empty  # as woq_avx2.cpp takes it
        return [*layer._avx2, bias], [_AVX2, layer.bits, group, layer.out_features]
    return None


# What csrc/decode_stack.cpp computes, and nothing else: RMSNorm -> fused qkv (a bias allowed) -> rotate-half
# rotary from the step's cos/sin -> GQA attention -> o -> add + RMSNorm -> fused gate_up -> SiLU * up -> down.
FUSED_ARCHITECTURES = ("llama", "qwen2", "mistral")
_LAYER_PARTS = {
    "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    "self_attn": {"qkv_proj", "o_proj"},
    "mlp": {"gate_up_proj", "down_proj"},
}


def unsupported_reason(model) -> str | None:
    """Why the fused stack cannot compute this model's layers (then the per-op path runs), or None.

    A model feature the C++ stack does not implement (a q/k norm, sliding windows, a MoE block, another
    norm or activation) must send the model to the layer loop, never be silently dropped: the check is on
    the architecture and on every module each layer holds, so a new part fails it."""
    arch = model.config.architecture
    if getattr(model, "tp_vocab_size", None) is not None:
        return "tensor parallelism (the fused stack has no all-reduce between its layers)"
    if arch not in FUSED_ARCHITECTURES:
        return f"architecture {arch!r} (the fused stack computes {', '.join(FUSED_ARCHITECTURES)})"
    if getattr(model.config, "sliding_window", None):
        return "sliding-window attention"
    rotary_dim = getattr(model.config, "rotary_dim", None)
    if rotary_dim is not None and rotary_dim != model.config.head_dim:
        return f"partial rotary ({rotary_dim} of {model.config.head_dim} dims; the fused stack turns whole heads)"
    for i, layer in enumerate(model.model.layers):
        for path, allowed in _LAYER_PARTS.items():
            module = layer.get_submodule(path) if path else layer
            extra = {name for name, child in module.named_children() if child is not None} - allowed
            if extra:
                return f"layer {i} {path or 'block'} has {', '.join(sorted(extra))}, which the fused stack lacks"
    return None


def build_decode_stack(model):
    """The C++ stack over `model`'s decoder layers, or None where it does not apply: a model feature it
    does not implement (unsupported_reason), a linear whose kernel it cannot call (an unquantized float32
    one, a layout other than the AMX one (amx tier, bf16), the AVX2 one (float32 or bf16) or prepacked
    bf16), activations other than float32 / bf16, or no compiler (or a CPU below avx2)."""
    dtype = model.model.embed_tokens.weight.dtype
    ext = load()
    if dtype not in (torch.float32, torch.bfloat16) or ext is None:
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        logger.info("decoder_stack: the per-op layer loop runs (%s)", reason)
        return None
    tensors: list[torch.Tensor] = []
    shapes: list[int] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != dtype for w in norms):
            return None
        tensors += [w.detach() for w in norms]
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts = _linear_parts(linear, dtype, ext.amx)
            if parts is None:
                return None
            tensors += parts[0]
            shapes += parts[1]
    attn = model.model.layers[0].self_attn
    eps = model.model.layers[0].input_layernorm.eps
    return ext.DecodeStack(tensors, shapes, attn.num_heads, attn.num_kv_heads, attn.head_dim, eps, attn.scale)


def is_fresh_prefill(meta: AttentionMetadata) -> bool:
    """One prompt's prefill with nothing cached before it (all its tokens new)."""
    return meta.num_seqs == 1 and meta.num_decodes == 0 and meta.query_start_loc[1] == meta.seq_lens[0]


def applies(meta: AttentionMetadata, x: torch.Tensor, kv_caches: list) -> bool:
    """Whether the stack runs this step: decodes only, or one fresh prefill, over a plain (unquantized)
    cache."""
    return (
        x.shape[0] > 0
        and (meta.num_decodes == meta.num_seqs or is_fresh_prefill(meta))
        and isinstance(kv_caches[0], torch.Tensor)
        and kv_caches[0].dtype == x.dtype
    )
