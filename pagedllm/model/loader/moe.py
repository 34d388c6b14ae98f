"""Mixture-of-experts checkpoints: their config fields, and their experts' tensors under the model's names.

The model (model/layers/moe.py) names a sparse layer's router `model.layers.{i}.mlp.gate.weight` and its
experts `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`, as Qwen3-MoE's and OLMoE's HF
checkpoints do. The other layouts are renamed (`hf_name`) and cut per expert (`split_experts`) at load:
    Mixtral's HF files    block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1 / w2 / w3 (gate / down / up)
    transformers 5        3-D parameters mlp.experts.gate_up_proj [E, 2F, D] ([gate; up] rows per expert)
                          and mlp.experts.down_proj [E, D, F], as its fused MoE modules hold them
    GGUF                  ffn_gate_inp, ffn_{gate,up,down}_exps [E, out, in] (the registry's names map them
                          to mlp.experts.{gate,up,down}_proj.weight, stacked); quantized ones are cut per
                          expert too: each expert's rows are contiguous whole blocks (split_experts_raw)
Plain data and torch, no model: the loaders' business.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.loader.registry import Architecture

_MIXTRAL_EXPERT = re.compile(r"(.+\.experts\.\d+\.)(w[123])\.weight")
_MIXTRAL_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# a stacked tensor of every expert: [E, out, in] ("gate_up" holds [gate; up] rows per expert)
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate|up|down|gate_up)_proj\.weight")


def _bad(where: Any, what: str) -> InputError:
    return InputError(f"{where}: {what}", param="model")


def _int_field(cfg: dict[str, Any], key: str, where: Any, low: int, high: int | None = None) -> int:
    value = cfg.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < low
        or (high is not None and value > high)
    ):
        limit = f"between {low} and {high}" if high is not None else f">= {low}"
        raise _bad(where, f"{key} must be a whole number {limit}; got {value!r}")
    return int(value)


def hf_moe_fields(entry: Architecture, cfg: dict[str, Any], num_layers: int, file: Path) -> dict[str, Any]:
    """ModelConfig's MoE fields from a config.json of a MoE family ({} for the others)."""
    if not entry.moe:
        return {}
    # Mixtral calls it num_local_experts, Qwen3-MoE and OLMoE num_experts (transformers 5 writes either)
    key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    num_experts = _int_field(cfg, key, file, 1)
    top_k = _int_field(cfg, "num_experts_per_tok", file, 1, num_experts)
    # Mixtral and OLMoE size their experts with intermediate_size; Qwen3-MoE's is that of its dense layers
    width_key = (
        "moe_intermediate_size" if cfg.get("moe_intermediate_size") is not None else "intermediate_size"
    )
    if entry.sliding_layers == "none" and cfg.get("use_sliding_window"):
        # Qwen3-MoE windows every layer with it (transformers ignores sliding_window without it)
        what = "use_sliding_window=True (sliding-window attention)"
        raise _bad(file, f"{what} is not supported for {entry.hf_architectures[0]}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_int_field(cfg, width_key, file, 1),
        norm_topk_prob=entry.moe_norm_topk == "always" or bool(cfg.get("norm_topk_prob", False)),
        dense_layers=_dense_layers(entry, cfg, num_layers, file),
    )


def _dense_layers(entry: Architecture, cfg: dict[str, Any], num_layers: int, file: Path) -> list[int]:
    """Qwen3-MoE's rule, as transformers applies it: layer i is sparse unless listed in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step. Other families have no dense layers."""
    step = cfg.get("decoder_sparse_step")
    if not entry.moe_dense_layers:
        if step not in (None, 1):
            what = f"decoder_sparse_step={step!r} (dense layers)"
            raise _bad(file, f"{what} is not supported for {entry.hf_architectures[0]}")
        return []
    step = 1 if step is None else _int_field(cfg, "decoder_sparse_step", file, 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in only
    ):
        raise _bad(file, f"mlp_only_layers must list layer indices below {num_layers}; got {only!r}")
    return [i for i in range(num_layers) if i in only or (i + 1) % step]


def gguf_moe_fields(
    entry: Architecture, meta: dict[str, Any], tensor_names: set[str], num_layers: int, path: Path
) -> dict[str, Any]:
    """ModelConfig's MoE fields from a GGUF file of a MoE family ({} for the others), as llama.cpp reads
    them: {arch}.expert_count / expert_used_count, the experts' width from expert_feed_forward_length or
    else feed_forward_length, top-k renormalisation by the family's rule unless expert_weights_norm says."""
    if not entry.moe:
        return {}
    arch = entry.gguf_architecture
    where = f"GGUF file {path}"
    keys = {k[len(arch) + 1 :]: v for k, v in meta.items() if k.startswith(f"{arch}.")}
    num_experts = _int_field(keys, "expert_count", f"{where} ({arch}.)", 1)
    top_k = _int_field(keys, "expert_used_count", f"{where} ({arch}.)", 1, num_experts)
    gating = keys.get("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX is 1
        raise _bad(
            where, f"{arch}.expert_gating_func={gating!r} (a router other than softmax) is not supported"
        )
    scale = keys.get("expert_weights_scale")
    if scale not in (None, 0, 0.0, 1, 1.0):
        raise _bad(where, f"{arch}.expert_weights_scale={scale!r} (scaled routing weights) is not supported")
    width_key = (
        "expert_feed_forward_length" if keys.get("expert_feed_forward_length") else "feed_forward_length"
    )
    # a layer without a router is dense: Qwen3-MoE's mlp_only_layers (llama.cpp itself expects none)
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if dense and not entry.moe_dense_layers:
        raise _bad(where, f"layer {dense[0]} has no blk.{dense[0]}.ffn_gate_inp (router) tensor")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_int_field(keys, width_key, f"{where} ({arch}.)", 1),
        norm_topk_prob=bool(keys.get("expert_weights_norm", entry.gguf_moe_norm_topk)),
        dense_layers=dense,
    )


def hf_config_keys(config: ModelConfig, entry: Architecture) -> dict[str, Any]:
    """The config.json keys hf_moe_fields reads back into the same fields (quantized folders from GGUF)."""
    if not config.num_experts:
        return {}
    keys: dict[str, Any] = {
        "num_local_experts" if entry.moe_norm_topk == "always" else "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
    }
    if entry.moe_norm_topk != "always":
        keys["norm_topk_prob"] = config.norm_topk_prob
    if entry.moe_dense_layers:
        keys.update(moe_intermediate_size=config.moe_intermediate_size, mlp_only_layers=config.dense_layers)
    elif config.moe_intermediate_size != config.intermediate_size:
        raise InputError(
            f"{entry.name}: experts of {config.moe_intermediate_size} and dense MLPs of "
            f"{config.intermediate_size} cannot be written as one intermediate_size",
            param="model",
        )
    return keys


def hf_name(name: str) -> str:
    """A checkpoint's tensor name under the model's: Mixtral's block_sparse_moe and w1/w2/w3, transformers
    5's 3-D expert parameters (given a .weight suffix); any other name as it is."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = _MIXTRAL_EXPERT.fullmatch(name)
    if m:
        return f"{m.group(1)}{_MIXTRAL_W[m.group(2)]}.weight"
    if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        return name + ".weight"
    return name


def _stacked_parts(
    name: str, rows: int, config: ModelConfig, where: Any
) -> tuple[str, list[tuple[str, int]]]:
    """(prefix, [(part, rows)]) of a stacked tensor's per-expert rows, which must add up to `rows`."""
    prefix, kind = _STACKED.fullmatch(name).groups()
    f = config.moe_intermediate_size
    parts = {"gate_up": [("gate_proj", f), ("up_proj", f)], "down": [("down_proj", config.hidden_size)]}
    expected = parts.get(kind, [(f"{kind}_proj", f)])
    if rows != sum(n for _, n in expected):
        raise _bad(where, f"{name} has {rows} rows per expert, config says {sum(n for _, n in expected)}")
    return prefix, expected


def split_experts(weights: dict[str, torch.Tensor], config: ModelConfig, where: Any) -> None:
    """In place: every stacked [E, out, in] expert tensor becomes E per-expert weights."""
    for name in [n for n in weights if _STACKED.fullmatch(n)]:
        stacked = weights.pop(name)
        if stacked.dim() != 3 or stacked.shape[0] != config.num_experts:
            raise _bad(
                where, f"{name} has shape {tuple(stacked.shape)}, expected [{config.num_experts}, out, in]"
            )
        prefix, parts = _stacked_parts(name, stacked.shape[1], config, where)
        for j, expert in enumerate(stacked):
            for part, piece in zip((p for p, _ in parts), expert.split([n for _, n in parts])):
                weights[f"{prefix}.{j}.{part}.weight"] = piece.contiguous()


def split_experts_raw(
    quantized: dict[str, tuple[str, np.ndarray, tuple[int, ...]]], config: ModelConfig, where: Any
) -> None:
    """split_experts on raw GGUF blocks (type, rows of blocks [E, out, bytes], shape [E, out, in]): a block
    never spans two rows, so each expert's rows are its own whole blocks."""
    for name in [n for n in quantized if _STACKED.fullmatch(n)]:
        qtype, raw, shape = quantized.pop(name)
        prefix, parts = _stacked_parts(name, shape[1], config, where)
        for j in range(shape[0]):
            start = 0
            for part, rows in parts:
                quantized[f"{prefix}.{j}.{part}.weight"] = (
                    qtype,
                    raw[j, start : start + rows],
                    (rows, shape[2]),
                )
                start += rows


def mlp_weight_names(config: ModelConfig, layer: int) -> list[str]:
    """The MLP weights layer `layer` needs: a dense gate/up/down, or a router and every expert's."""
    p = f"model.layers.{layer}.mlp."
    if not config.is_moe_layer(layer):
        return [p + f"{x}_proj.weight" for x in ("gate", "up", "down")]
    experts = [
        p + f"experts.{j}.{x}_proj.weight" for j in range(config.num_experts) for x in ("gate", "up", "down")
    ]
    return [p + "gate.weight", *experts]


def mlp_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Shapes to check a checkpoint's MLPs by: the first dense layer's gate_proj, the first sparse layer's
    router and first expert's gate_proj."""
    d = config.hidden_size
    shapes: dict[str, tuple[int, int]] = {}
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    sparse = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    if dense:
        shapes[f"model.layers.{dense[0]}.mlp.gate_proj.weight"] = (config.intermediate_size, d)
    if sparse:
        p = f"model.layers.{sparse[0]}.mlp."
        shapes[p + "gate.weight"] = (config.num_experts, d)
        shapes[p + "experts.0.gate_proj.weight"] = (config.moe_intermediate_size, d)
    return shapes
