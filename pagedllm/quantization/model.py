"""Swap a model's nn.Linear layers for QuantLinear in place, with any weight quantizer plugged in.

A quantization method is a function

    quantize_weight(name: str, weight: Tensor [out, in] float32, bits: int, group_size: int | None)
        -> uniform.QuantizedTensor   (per channel: axis=0; group-wise along the input: axis=1)

`name` is the layer's full module name (e.g. "model.layers.3.mlp.down_proj"), so a method that needs
per-layer state (calibration statistics) can look it up. RTN (rtn.rtn_method) is the default:

    quantize_model(model, bits=4, group_size=32)                          # RTN, INT4 g32
    quantize_model(model, bits=4, group_size=128, quantize_weight=my_fn)  # any method
    replace_linears(model, {name: qt, ...})                               # AWQ/GPTQ results, computed elsewhere

Only the decoder layers' linears are replaced by default (a MoE layer's experts included: each is a few
nn.Linear); embed_tokens, lm_head (tied to the embedding in small models) and a MoE router (`mlp.gate`,
[experts, hidden]: tiny, and its scores pick the experts, so llama.cpp and vLLM keep it in float too) stay
in float. Which rows run on which kernel: linear.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from tqdm import tqdm

from pagedllm.errors import InputError
from pagedllm.quantization.linear import QuantLinear, check_layer_shape
from pagedllm.quantization.rtn import rtn_method
from pagedllm.quantization.uniform import QuantizedTensor

WeightQuantizer = Callable[[str, torch.Tensor, int, "int | None"], QuantizedTensor]
DEFAULT_SKIP = ("lm_head", "embed_tokens", "gate")  # "gate": a MoE router (not gate_proj: names match whole)


def linear_layer_names(model: nn.Module, skip: Iterable[str] = DEFAULT_SKIP) -> list[str]:
    """Names of the nn.Linear modules that quantize_model would replace, in model order."""
    skip = tuple(skip)
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(s in name.split(".") for s in skip)
    ]


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def find_linear(model: nn.Module, name: str) -> nn.Linear | None:
    """The nn.Linear called `name`, or None when there is none (or it is something else)."""
    try:
        m = model.get_submodule(name)
    except AttributeError:
        return None
    return m if isinstance(m, nn.Linear) else None


def _linear(model: nn.Module, name: str) -> nn.Linear:
    m = find_linear(model, name)
    if m is None:
        raise InputError(f"{name} is not an nn.Linear layer of this model", param="layers")
    return m


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        return p.dtype
    return torch.float32


def replace_linears(
    model: nn.Module, quantized: Mapping[str, QuantizedTensor], bias: torch.Tensor | None = None
) -> int:
    """Install QuantLinear layers from {module name: QuantizedTensor}; returns resident weight bytes.

    Each layer keeps the old layer's bias (or `bias`, when one layer is given, e.g. in float32)."""
    dtype = _model_dtype(model)
    for name, qt in quantized.items():
        old = _linear(model, name)
        if tuple(qt.codes.shape) != tuple(old.weight.shape):
            raise InputError(
                f"{name}: quantized shape {tuple(qt.codes.shape)} != weight {tuple(old.weight.shape)}",
                param="layers",
            )
        b = bias if bias is not None and len(quantized) == 1 else old.bias
        layer = QuantLinear.from_quantized(qt, bias=None if b is None else b.detach(), name=name)
        layer.pack(dtype)  # build the kernel layout now, so weight_bytes() is right from the start
        set_module(model, name, layer)
    return resident_weight_bytes(model)


def quantize_model(
    model: nn.Module,
    bits: int = 4,
    group_size: int | None = 32,
    quantize_weight: WeightQuantizer = rtn_method,
    layers: Iterable[str] | None = None,
    skip: Iterable[str] = DEFAULT_SKIP,
    show_progress: bool = False,
    source_weights: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """Replace the nn.Linear layers (all but `skip`, or exactly `layers`) with QuantLinear in place.

    Every layer's shape is checked before any is touched, so a bad group size leaves the model intact.
    source_weights ({"...q_proj.weight": float32 tensor}, e.g. the checkpoint) are quantized instead of the
    model's own (maybe bf16-rounded) weights and biases. Returns the resident weight bytes afterwards.
    """
    names = list(layers) if layers is not None else linear_layer_names(model, skip)
    for name in names:
        check_layer_shape(name, _linear(model, name).in_features, bits, group_size)
    for name in tqdm(names, desc=f"quantizing ({bits}-bit)", unit="linear", disable=not show_progress):
        layer = model.get_submodule(name)
        src = source_weights or {}
        weight = src.get(f"{name}.weight", layer.weight)
        with torch.no_grad():
            qt = quantize_weight(name, weight.detach().float(), bits, group_size)
        replace_linears(model, {name: qt}, src.get(f"{name}.bias"))
    return resident_weight_bytes(model)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters (tied ones once) plus QuantLinear's buffers and packed layout; no caches."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        # QuantLinear, and model/layers/packed_linear.py's opaque oneDNN layout: they count their own bytes
        if hasattr(m, "weight_bytes"):
            total += m.weight_bytes()
            continue
        for t in m.parameters(recurse=False):
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
