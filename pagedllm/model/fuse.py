"""The inference layout of a loaded model: q/k/v and gate/up merged, bf16 weights prepacked for oneDNN.

Loaders, quantizers (AWQ, GPTQ, RTN) and quantized checkpoints all speak the checkpoint's names
(q_proj, k_proj, v_proj, gate_proj, up_proj), so the model is built that way. Once it is final (and cut
to its tensor-parallel share), build.load_model_for_inference calls `fuse_for_inference`: each layer
then runs 4 matmuls instead of 7 (one [960 x 576] call for q/k/v and one [3072 x 576] for gate/up on
the default model), which on 2 CPU cores saves the fixed cost of 90 oneDNN calls a step, and bf16
weights are reordered once (layers/packed_linear.py) instead of on every call. Outputs are the same
rows of the same products, only computed together.
Merged quantized layers get their kernel layouts built (quantization/linear.py, pack), and where every
decoder linear is prepacked bf16 or in the AMX layout, decode steps and fresh prefills run all layers in
one C++ call (decode_stack.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm import ops
from pagedllm.model.decode_stack import build_decode_stack
from pagedllm.model.layers.packed_linear import PackedLinear
from pagedllm.platform import release_free_heap
from pagedllm.quantization.linear import QuantLinear

logger = logging.getLogger(__name__)


def merge_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer for several that read the same input, or None when their kinds differ."""
    if all(type(m) is nn.Linear for m in layers):
        dtypes = {m.weight.dtype for m in layers}
        if len(dtypes) != 1:
            return None
        weight = torch.cat([m.weight.detach() for m in layers])
        has_bias = any(m.bias is not None for m in layers)
        merged = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if has_bias:
            parts = [
                m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in layers
            ]
            merged.bias = nn.Parameter(torch.cat(parts), requires_grad=False)
        return merged
    if all(isinstance(m, QuantLinear) for m in layers):
        try:
            return QuantLinear.concat(layers)
        except ValueError:  # different bits or group sizes (a mixed-precision checkpoint)
            return None
    return None


def prepack(layer: nn.Module) -> nn.Module:
    """A PackedLinear for a bf16 CPU nn.Linear, else the layer itself (callers check the op table)."""
    if (
        type(layer) is nn.Linear
        and layer.weight.dtype == torch.bfloat16
        and layer.weight.device.type == "cpu"
    ):
        return PackedLinear(layer.weight, layer.bias)
    return layer


def fuse_for_inference(model: nn.Module) -> None:
    """Merge and prepack in place (idempotent). After it the model serves; it no longer quantizes."""
    pack = ops.backend("linear") == "onednn-prepacked"
    merged = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        # a MoE layer's experts are each a gated MLP (model/layers/moe.py); its router stays as it is
        mlps = list(getattr(layer.mlp, "experts", [layer.mlp]))
        if attn.qkv_proj is None:
            qkv = merge_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            release_free_heap()  # the merge's transients (glibc keeps them resident otherwise)
            if qkv is not None:
                attn.qkv_proj = qkv
                del attn.q_proj, attn.k_proj, attn.v_proj
                merged += 1
        for mlp in mlps:
            if mlp.gate_up_proj is None:
                gate_up = merge_linears([mlp.gate_proj, mlp.up_proj])
                release_free_heap()
                if gate_up is not None:
                    mlp.gate_up_proj = gate_up
                    del mlp.gate_proj, mlp.up_proj
                    merged += 1
        if pack:
            for parent, names in (
                (attn, ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")),
                *((mlp, ("gate_up_proj", "gate_proj", "up_proj", "down_proj")) for mlp in mlps),
            ):
                for name in names:
                    child = getattr(parent, name, None)
                    if child is not None:
                        setattr(parent, name, prepack(child))
    if pack:
        # the largest matmul of a decode step. A tied lm_head gets its own packed copy of the embedding
        # (+56 MB on the default model, counted by resident_weight_bytes): 17 -> 12 ms at 32 rows, 1 thread
        model.lm_head = prepack(model.lm_head)
    # merged quantized layers: build their kernel layouts now, so resident bytes are right from the start
    dtype = model.dtype
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.pack(dtype)
    model.decode_stack = build_decode_stack(model)
    release_free_heap()
    logger.debug(
        "fused %d projection groups; bf16 weights prepacked: %s; C++ decode stack: %s",
        merged,
        pack,
        model.decode_stack is not None,
    )
