"""Hugging Face config.json -> ModelConfig, and the list of weight names a config needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.loader import registry


def _field(cfg: dict[str, Any], key: str, file: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise InputError(f"{file}: missing field {key!r}", param="model")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None). transformers 5 writes rope_parameters; 4.x rope_theta/rope_scaling."""
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(merged.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    if "type" in merged:  # old spelling of rope_type
        merged.setdefault("rope_type", merged.pop("type"))
        merged.pop("type", None)
    if merged.get("rope_type", "default") == "default":
        return theta, None
    return theta, merged


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
    # no sliding-window attention here: the registry's policy caps the context where a window would matter
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    max_pos = registry.hf_context_length(entry, cfg, max_pos, str(file))
    attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(_field(cfg, "vocab_size", file)),
        hidden_size=hidden,
        intermediate_size=int(_field(cfg, "intermediate_size", file)),
        num_layers=int(_field(cfg, "num_hidden_layers", file)),
        num_heads=n_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; Llama and Qwen3 have q/k/v/o bias when attention_bias is set.
        attention_bias=entry.qkv_bias or attention_bias,
        o_proj_bias=attention_bias and entry.o_bias_with_attention_bias,
        qk_norm=entry.qk_norm,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        architecture=entry.name,
    )


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Names the model needs: the registry entry's features decide the biases and the q/k norms."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if config.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def check_complete(weights: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    missing = [n for n in expected_weight_names(config) if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise InputError(f"checkpoint {path} lacks tensors {', '.join(missing[:3])}{more}", param="model")
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.layers.0.self_attn.q_proj.weight": (config.num_heads * config.head_dim, config.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (config.kv_width, config.hidden_size),
        "model.layers.0.mlp.gate_proj.weight": (config.intermediate_size, config.hidden_size),
    }
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise InputError(
                f"checkpoint {path}: {name} has shape {tuple(weights[name].shape)}, config says {shape}",
                param="model",
            )
