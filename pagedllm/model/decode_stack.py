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

Whether a model can take the stack is decided once, with the model, at build: `supports(model)` gives the
reason it cannot (then the layer loop runs, and `pagedllm env --model M` prints that reason), or None.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedllm import ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model.layers.packed_linear import PackedLinear
from pagedllm.quantization import avx2
from pagedllm.quantization.linear import QuantLinear

SOURCE = Path(__file__).parent / "csrc" / "decode_stack.cpp"
logger = logging.getLogger("pagedllm")


# csrc/decode_stack.cpp's LinearKind
_PACKED, _AMX, _AVX2 = 0, 1, 2


def _linear_parts(layer, dtype: torch.dtype, amx_build: bool) -> tuple[list[torch.Tensor], list[int]] | str:
    """What the C++ Linear holds (csrc/decode_stack.cpp) for the kernel the layer itself runs for `dtype`
    activations: four tensors and (kind, bits, group_size, out_features); or why the stack cannot make
    that call."""
    empty = torch.empty(0)
    if isinstance(layer, PackedLinear):
        if dtype != torch.bfloat16:
            return f"a prepacked linear under {dtype} activations"
        bias = layer.bias if layer.bias is not None else empty
        return [layer.packed_weight, empty, empty, bias], [_PACKED, 0, 0, layer.out_features]
    if not isinstance(layer, QuantLinear):
        return f"a {type(layer).__name__} (the stack calls quantized or prepacked bf16 linears)"
    layer.pack(dtype)  # the kernel this layer runs (idempotent: fuse.py packed it already)
    kernel = layer.kernel.name if layer.kernel is not None else "the torch reference"
    if kernel == "amx" and amx_build:
        bias = layer.bias.to(torch.bfloat16) if layer.bias is not None else empty  # as forward() rounds it
        return [*layer.layout, bias], [_AMX, layer.bits, layer.group, layer.out_features]
    if kernel == "avx2":  # the AVX2 kernel serves every row count, so one row's kernel is every step's
        bias = layer.bias.float() if layer.bias is not None else empty  # as woq_avx2.cpp takes it
        bits = avx2.layout_bits(layer.layout)  # 6 for Q6_K's codes kept in 6 bits
        return [*layer.layout, bias], [_AVX2, bits, layer.group, layer.out_features]
    return f"a {layer.bits}-bit linear on {kernel} (the stack calls the amx and avx2 kernels' layouts)"


# What csrc/decode_stack.cpp computes, and nothing else: RMSNorm -> fused qkv (a bias allowed) -> rotate-half
# rotary from the step's cos/sin -> GQA attention -> o -> add + RMSNorm -> fused gate_up -> SiLU * up -> down.
FUSED_ARCHITECTURES = ("llama", "qwen2", "mistral")
_LAYER_PARTS = {
    "": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    "self_attn": {"qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj"},
    "mlp": {"gate_up_proj", "gate_proj", "up_proj", "down_proj"},
}


def _projections(layer) -> list[tuple[str, list]]:
    """A layer's four projections in the stack's order, each as its linears: the merged one, or the parts
    fuse.py could not merge (q, k, v of different GGUF types: Q4_K_M's Q6_K attn_v beside Q4_K q and k),
    whose outputs the stack concatenates as the layer loop does."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    return [
        ("qkv_proj", qkv),
        ("o_proj", [attn.o_proj]),
        ("gate_up_proj", gate_up),
        ("down_proj", [mlp.down_proj]),
    ]


def unsupported_reason(model) -> str | None:
    """Why the fused stack cannot compute this model's layers (then the layer loop runs), or None.

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
                return (
                    f"layer {i} {path or 'block'} has {', '.join(sorted(extra))}, which the fused stack lacks"
                )
    return None


# the per-call ops the stack makes itself: forcing any of them to its reference sends steps to the layer loop
STACK_OPS = (
    "decoder_stack",
    "layer_ops",
    "attention_decode",
    "write_kv",
    "attention_prefill",
    "quantized_linear",
    "lora",
)


def _parts(model) -> tuple[list[torch.Tensor], list[int]] | str:
    """Every decoder layer's norms and linears as the C++ stack takes them, or why it cannot."""
    ext = ops.kernel("decoder_stack")
    if ext is None:
        return (
            f"no fused decoder stack on this machine (op table: decoder_stack={ops.backend('decoder_stack')})"
        )
    dtype = model.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} activations (the stack takes float32 and bf16)"
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    tensors: list[torch.Tensor] = []
    shapes: list[int] = []
    for i, layer in enumerate(model.model.layers):
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != dtype for w in norms):
            return f"layer {i} has norm weights of another dtype than its {dtype} activations"
        projections = _projections(layer)
        tensors += [w.detach() for w in norms]
        shapes += [len(projections[0][1]), len(projections[2][1])]  # the qkv and gate_up linears' counts
        for name, linears in projections:
            for linear in linears:
                parts = _linear_parts(linear, dtype, ext.amx)
                if isinstance(parts, str):
                    return f"layer {i} {name} is {parts}"
                tensors += parts[0]
                shapes += parts[1]
    return tensors, shapes


def supports(model) -> str | None:
    """None where the fused stack computes this model's decoder layers on this machine, else why not
    (then the model's layer loop runs). Asked once, at build (fuse.py), and by `pagedllm env --model`."""
    parts = _parts(model)
    return parts if isinstance(parts, str) else None


def build_decode_stack(model):
    """The C++ stack over `model`'s decoder layers, or None where it does not apply (`supports` says why,
    logged once)."""
    parts = _parts(model)
    if isinstance(parts, str):
        logger.info("decoder_stack: the model's layer loop runs (%s)", parts)
        return None
    tensors, shapes = parts
    attn = model.model.layers[0].self_attn
    eps = model.model.layers[0].input_layernorm.eps
    ext = ops.kernel("decoder_stack")
    return ext.DecodeStack(tensors, shapes, attn.num_heads, attn.num_kv_heads, attn.head_dim, eps, attn.scale)


def is_fresh_prefill(meta: AttentionMetadata) -> bool:
    """One prompt's prefill with nothing cached before it (all its tokens new)."""
    return meta.num_seqs == 1 and meta.num_decodes == 0 and meta.query_start_loc[1] == meta.seq_lens[0]


def applies(meta: AttentionMetadata, x: torch.Tensor, kv_caches: list) -> bool:
    """Whether the stack runs this step: decodes only, or one fresh prefill, over a plain (unquantized)
    cache, and none of the ops it makes forced to another backend (ops.forced: the reference must run)."""
    return (
        x.shape[0] > 0
        and not ops.any_forced(STACK_OPS)
        and (meta.num_decodes == meta.num_seqs or is_fresh_prefill(meta))
        and isinstance(kv_caches[0], torch.Tensor)
        and kv_caches[0].dtype == x.dtype
    )
