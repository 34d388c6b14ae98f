"""Tiny random-weight Hugging Face checkpoints for tests (HF-vs-ours logits, loader round trips).

The folders are complete: config.json, model.safetensors (or shards), and the default model's tokenizer
(SmolLM2's 49152-token vocabulary, with its chat template), so anything that loads a model folder works.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Shapes the logits tests use; GQA in both, head_dim 16 and 32.
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
TINY_QWEN2 = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1)
# head_dim 24 is not hidden / heads (16), as in the real Qwen3 models (head_dim 128 everywhere)
TINY_QWEN3 = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24
)

# Phi-3: fused qkv_proj / gate_up_proj; head_dim 16, so partial_rotary_factor 0.75 turns 12 dims of each head
TINY_PHI3 = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


@functools.lru_cache(maxsize=1)
def default_hf_tokenizer():
    from pagedllm.model.loader import default_model_path
    from pagedllm.model.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(default_model_path()).hf


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF init leaves norms at 1 and biases at 0 and keeps weights tiny (logits ~uniform); a comparison
    against such a model would miss a dropped bias or norm, so draw everything at O(1) scale."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear [out, in], experts [E, out, in]: unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _save(model: torch.nn.Module, path: Path, max_shard_size: str | int | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    default_hf_tokenizer().save_pretrained(path)
    return path


def _config_kwargs(shape: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    tok = default_hf_tokenizer()
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tok),
        intermediate_size=3 * shape["hidden_size"],
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kwargs.update(shape)
    kwargs.update(overrides)
    return kwargs


def _save_random(model_cls, config_cls, shape, path, seed, max_shard_size, overrides, tie) -> Path:
    kwargs = _config_kwargs(shape, overrides)
    kwargs.setdefault("tie_word_embeddings", tie)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    _randomize(model, seed)
    return _save(model, Path(path), max_shard_size)


def save_tiny_llama(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """Write a random LlamaForCausalLM (TINY_LLAMA shape, untied lm_head unless overridden) to `path`.

    config_overrides go to LlamaConfig, e.g. hidden_size=96, attention_bias=True, tie_word_embeddings=True,
    rope_theta=..., rope_scaling={...}. Returns the folder.
    """
    return _save_random(
        LlamaForCausalLM, LlamaConfig, TINY_LLAMA, path, seed, max_shard_size, config_overrides, False
    )


def save_tiny_qwen2(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """Write a random Qwen2ForCausalLM (TINY_QWEN2 shape: q/k/v bias, tied embeddings) to `path`."""
    return _save_random(
        Qwen2ForCausalLM, Qwen2Config, TINY_QWEN2, path, seed, max_shard_size, config_overrides, True
    )


def save_tiny_qwen3(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """Write a random Qwen3ForCausalLM (TINY_QWEN3 shape: q/k norms, head_dim 24, no bias, tied
    embeddings) to `path`. The q/k norm weights are drawn around 1 like every other norm."""
    return _save_random(
        Qwen3ForCausalLM, Qwen3Config, TINY_QWEN3, path, seed, max_shard_size, config_overrides, True
    )


def save_tiny_phi3(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """Write a random Phi3ForCausalLM (TINY_PHI3 shape: fused qkv_proj and gate_up_proj, untied lm_head)
    to `path`. config_overrides go to Phi3Config, e.g. partial_rotary_factor=0.75, or
    rope_scaling={"type": "longrope", "short_factor": [...], "long_factor": [...]} with
    original_max_position_embeddings=..."""
    return _save_random(
        Phi3ForCausalLM, Phi3Config, TINY_PHI3, path, seed, max_shard_size, config_overrides, False
    )


# Gemma 2/3: head_dim 16 with query_pre_attn_scalar 24 (the scale is not 1/sqrt(head_dim)), a sliding window
# of 20 (shorter than the 100-token prompts, not a multiple of the 16-token block), tied embeddings
TINY_GEMMA2 = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=20,
    attn_logit_softcapping=5.0,  # small caps, so random scores and logits really are capped
    final_logit_softcapping=3.0,
)
# Gemma 3: layers 0, 1, 3, 4 windowed, 2 global (pattern 3); its two RoPE bases and linear scaling
TINY_GEMMA3 = dict(
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=20,
    sliding_window_pattern=3,
    rope_theta=100000.0,
    rope_local_base_freq=1000.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
)
# Mistral with a window of 20 over every layer: blocks before it are freed as a request moves on
TINY_MISTRAL = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, sliding_window=20
)


def save_tiny_gemma2(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """A random Gemma2ForCausalLM (TINY_GEMMA2: soft-capping, sandwich norms, alternating windows)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _save_random(
        Gemma2ForCausalLM, Gemma2Config, TINY_GEMMA2, path, seed, max_shard_size, config_overrides, True
    )


def save_tiny_gemma3(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """A random Gemma3ForCausalLM text model (TINY_GEMMA3: q/k norms, local and global RoPE bases)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _save_random(
        Gemma3ForCausalLM, Gemma3TextConfig, TINY_GEMMA3, path, seed, max_shard_size, config_overrides, True
    )


def save_tiny_mistral(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """A random MistralForCausalLM with a 20-token sliding window on every layer (TINY_MISTRAL)."""
    from transformers import MistralConfig, MistralForCausalLM

    return _save_random(
        MistralForCausalLM, MistralConfig, TINY_MISTRAL, path, seed, max_shard_size, config_overrides, False
    )


# Mixtures of experts: 8 experts, top-2, experts 32 wide. Qwen3-MoE: layer 1 dense (mlp_only_layers, its MLP
# intermediate_size 96), head_dim 24, top-k renormalised; OLMoE: q/k norms over the whole projection,
# clip_qkv small enough to clip, top-k not renormalised (its released setting); Mixtral always renormalises
_MOE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
TINY_MIXTRAL = dict(_MOE, num_hidden_layers=2, num_local_experts=8, intermediate_size=32)
TINY_QWEN3_MOE = dict(
    _MOE,
    num_hidden_layers=3,
    head_dim=24,
    num_experts=8,
    moe_intermediate_size=32,
    intermediate_size=96,
    mlp_only_layers=[1],
    norm_topk_prob=True,
)
TINY_OLMOE = dict(
    _MOE, num_hidden_layers=2, num_experts=8, intermediate_size=32, clip_qkv=1.5, norm_topk_prob=False
)


def save_tiny_mixtral(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """A random MixtralForCausalLM (TINY_MIXTRAL: 8 experts, top-2, untied lm_head). transformers writes
    the Hub's layout: block_sparse_moe.gate and block_sparse_moe.experts.{j}.w1/w2/w3."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _save_random(
        MixtralForCausalLM, MixtralConfig, TINY_MIXTRAL, path, seed, max_shard_size, config_overrides, False
    )


def save_tiny_qwen3_moe(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """A random Qwen3MoeForCausalLM (TINY_QWEN3_MOE: per-head q/k norms, one dense layer, tied)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    classes = (Qwen3MoeForCausalLM, Qwen3MoeConfig)
    return _save_random(*classes, TINY_QWEN3_MOE, path, seed, max_shard_size, config_overrides, True)


def save_tiny_olmoe(
    path: str | Path, seed: int = 0, max_shard_size: str | int | None = None, **config_overrides: Any
) -> Path:
    """A random OlmoeForCausalLM (TINY_OLMOE: whole-projection q/k norms, clip_qkv, untied)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return _save_random(
        OlmoeForCausalLM, OlmoeConfig, TINY_OLMOE, path, seed, max_shard_size, config_overrides, False
    )


def hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The float32 state dict transformers itself loads from a tiny folder (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
