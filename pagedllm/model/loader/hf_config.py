"""Hugging Face config.json -> ModelConfig, and the list of weight names a config needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError

# HF class name -> our architecture tag; model_type is the fallback when "architectures" is absent.
SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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
    archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))]
    arch = archs[0]
    if arch not in SUPPORTED_HF_ARCHS:
        raise InputError(
            f"{file}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_HF_ARCHS)})",
            param="model",
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise InputError(f"{file}: unsupported hidden_act {cfg['hidden_act']!r} (only silu)", param="model")
    if cfg.get("mlp_bias"):
        raise InputError(f"{file}: mlp_bias=true is not supported", param="model")
    hidden = int(_field(cfg, "hidden_size", file))
    n_heads = int(_field(cfg, "num_attention_heads", file))
    theta, scaling = _rope(cfg)
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    # We have no sliding-window attention: cap the context where the window would start to matter, so
    # results stay exact instead of silently diverging from the reference.
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM")
    if window and uses_window and int(window) < max_pos:
        max_pos = int(window)
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
        # Qwen2 always has q/k/v bias; Llama has q/k/v/o bias when attention_bias is set.
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        architecture=SUPPORTED_HF_ARCHS[arch],
    )


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Names the model needs (o_proj.bias is optional: Llama with attention_bias has it, Qwen2 not)."""
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
