"""Hugging Face config.json -> ModelConfig, and the list of weight names a config needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.loader import moe, registry


def _field(cfg: dict[str, Any], key: str, file: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise InputError(f"{file}: missing field {key!r}", param="model")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None). transformers 5 writes rope_parameters; 4.x rope_theta/rope_scaling.
    Gemma 3's rope_parameters are per layer type: the global layers' are these (_local_rope_theta the rest)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["full_attention"] or {}
    merged = {**(cfg.get("rope_scaling") or {}), **params}
    theta = float(merged.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    merged.pop("partial_rotary_factor", None)  # ModelConfig.rotary_dim carries it
    if "type" in merged:  # old spelling of rope_type
        merged.setdefault("rope_type", merged.pop("type"))
        merged.pop("type", None)
    if merged.get("rope_type", "default") == "default":
        return theta, None
    return theta, merged


def _longrope(scaling: dict, cfg: dict[str, Any], rotary_dim: int, file: Path) -> dict:
    """LongRoPE's parameters made whole (model/layers/rotary.py): original_max_position_embeddings (Phi-3
    keeps it at the config's top level) and the attention factor, from config.json's max_position_embeddings
    before any context cap, as transformers computes it."""
    from pagedllm.model.layers.rotary import longrope_attention_factor

    scaling = dict(scaling)
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise InputError(
            f"{file}: rope_scaling.type 'longrope' needs original_max_position_embeddings", param="model"
        )
    scaling["original_max_position_embeddings"] = int(original)
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
            raise InputError(
                f"{file}: rope_scaling.{key} must be a list of {rotary_dim // 2} numbers (rotary dims / 2)",
                param="model",
            )
        scaling[key] = [float(f) for f in factors]
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    scaling["attention_factor"] = longrope_attention_factor(scaling, max_pos)
    return scaling


def _local_rope_theta(entry: registry.Architecture, cfg: dict[str, Any], file: Path) -> float | None:
    """Gemma 3's sliding layers' RoPE base: rope_parameters.sliding_attention (transformers 5) or
    rope_local_base_freq (4.x), 10000 by default; their RoPE has no scaling."""
    if not entry.local_rope_base:
        return None
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise InputError(
            f"{file}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not supported "
            "(the sliding layers' RoPE is unscaled)",
            param="model",
        )
    return float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)


def read_hf_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    file = folder / "config.json"
    if not file.is_file():
        raise InputError(f"model folder {folder} has no config.json", param="model")
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{file} is not valid JSON: {e}", param="model") from None
    entry = registry.from_hf(registry.hf_architecture_name(cfg), str(file))
    registry.check_hf_features(entry, cfg, str(file))
    hidden = int(_field(cfg, "hidden_size", file))
    n_heads = int(_field(cfg, "num_attention_heads", file))
    theta, scaling = _rope(cfg)
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    prf = registry.partial_rotary_factor(cfg)  # check_hf_features allowed it only where the family has it
    rotary_dim = int(head_dim * prf) if prf != 1.0 else None
    if rotary_dim is not None and (rotary_dim <= 0 or rotary_dim % 2):
        raise InputError(
            f"{file}: partial_rotary_factor={prf} gives {rotary_dim} rotary dims (must be even and > 0)",
            param="model",
        )
    if scaling and entry.name == "phi3" and scaling.get("rope_type") in ("su", "yarn"):
        scaling["rope_type"] = "longrope"  # old Phi-3 spellings, as transformers' Phi3Config reads them
    if scaling and scaling.get("rope_type") == "longrope":
        scaling = _longrope(scaling, cfg, rotary_dim or head_dim, file)
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    num_layers = int(_field(cfg, "num_hidden_layers", file))
    window, layer_types = registry.sliding_window_layers(entry, cfg, num_layers, max_pos, str(file))
    attention_bias = bool(cfg.get("attention_bias", False))
    gemma = entry.gemma
    scalar = cfg.get("query_pre_attn_scalar") if gemma else None
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(_field(cfg, "vocab_size", file)),
        hidden_size=hidden,
        intermediate_size=int(_field(cfg, "intermediate_size", file)),
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", entry.tie_word_embeddings_default)),
        # Qwen2 always has q/k/v bias; Llama and Qwen3 have q/k/v/o bias when attention_bias is set.
        attention_bias=entry.qkv_bias or attention_bias,
        o_proj_bias=attention_bias and entry.o_bias_with_attention_bias,
        qk_norm=entry.qk_norm,
        qk_norm_full=entry.qk_norm_full,
        clip_qkv=_float_or_none(cfg.get("clip_qkv")) if entry.clip_qkv else None,
        **moe.hf_moe_fields(entry, cfg, num_layers, file),
        rotary_dim=rotary_dim,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=_local_rope_theta(entry, cfg, file),
        hidden_act=registry.hidden_act(cfg),
        gemma_norms=gemma,
        attn_logit_softcapping=_float_or_none(cfg.get("attn_logit_softcapping")) if gemma else None,
        final_logit_softcapping=_float_or_none(cfg.get("final_logit_softcapping")) if gemma else None,
        query_pre_attn_scalar=float(scalar) if scalar else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        architecture=entry.name,
    )


def _float_or_none(value: Any) -> float | None:
    return float(value) if value else None


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Names the model needs: the registry entry's features decide the biases and the q/k norms."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += moe.mlp_weight_names(config, i)  # a dense MLP, or a router and experts
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if config.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.gemma_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    return names


def split_fused(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    """In place: each layer's fused self_attn.qkv_proj ([q; k; v] rows) and mlp.gate_up_proj ([gate; up]
    rows), as Phi-3 stores them, become q/k/v_proj and gate/up_proj, so quantizers, tensor parallelism and
    fuse.py (which merges them again) see the usual names."""
    q, kv, f = config.num_heads * config.head_dim, config.kv_width, config.intermediate_size
    for name in [
        n for n in weights if n.endswith((".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight"))
    ]:
        tensor = weights.pop(name)
        prefix, kind = name.rsplit(".", 1)
        prefix = prefix.rsplit(".", 1)[0]
        if ".qkv_proj." in name:
            sizes, parts = (q, kv, kv), ("q_proj", "k_proj", "v_proj")
        else:
            sizes, parts = (f, f), ("gate_proj", "up_proj")
        if tensor.shape[0] != sum(sizes):
            raise InputError(
                f"checkpoint {path}: {name} has {tensor.shape[0]} rows, config says {sum(sizes)} "
                f"({' + '.join(map(str, sizes))})",
                param="model",
            )
        for part, piece in zip(parts, tensor.split(sizes, dim=0)):
            weights[f"{prefix}.{part}.{kind}"] = piece.contiguous()


def check_complete(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    missing = [n for n in expected_weight_names(config) if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise InputError(f"checkpoint {path} lacks tensors {', '.join(missing[:3])}{more}", param="model")
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.layers.0.self_attn.q_proj.weight": (config.num_heads * config.head_dim, config.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (config.kv_width, config.hidden_size),
        **moe.mlp_shapes(config),
    }
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise InputError(
                f"checkpoint {path}: {name} has shape {tuple(weights[name].shape)}, config says {shape}",
                param="model",
            )
