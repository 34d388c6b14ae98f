"""What /api/tags, /api/show and /api/ps say about the served model: its file, shape and capabilities.

Read once, when first asked: a GGUF's header (its key/values, as Ollama's model_info shows them) and the
file's size and time; the rest comes from the engine's ModelConfig, so a model without a file (a test's
fake engine) is described too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.entrypoints.openai.ollama.protocol import OllamaModelDetails, rfc3339
from pagedllm.errors import InputError
from pagedllm.model.loader import resolve_model_path
from pagedllm.model.loader.gguf import read_gguf_header

logger = logging.getLogger("pagedllm.server")

# llama.cpp's LLAMA_FTYPE_* (GGUF general.file_type) -> the name Ollama shows as quantization_level
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}  # fmt: skip
TORCH_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass
class ModelFacts:
    size: int  # bytes of the weights' files
    digest: str
    modified_at: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    template: str


def parameter_count(cfg: Any) -> int:
    """The decoder's parameters from its shape (embeddings, attention, MLP or experts, norms)."""
    get = lambda name, default=0: getattr(cfg, name, default) or default  # noqa: E731
    hidden, layers, vocab = get("hidden_size"), get("num_layers"), get("vocab_size")
    heads, kv_heads = get("num_heads"), get("num_kv_heads")
    head_dim = get("head_dim") or (hidden // heads if heads else 0)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * get("intermediate_size")
    experts = get("num_experts")
    if experts:
        dense = len(get("dense_layers", []))
        moe = experts * 3 * hidden * get("moe_intermediate_size") + experts * hidden
        per_layer_mlp = (dense * mlp + (layers - dense) * moe) / max(layers, 1)
    else:
        per_layer_mlp = mlp
    embeddings = vocab * hidden * (1 if get("tie_word_embeddings", False) else 2)
    return int(embeddings + layers * (attention + per_layer_mlp + 2 * hidden) + hidden)


def human_count(n: int) -> str:
    """Ollama's parameter_size: 134.52M, 8.0B."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.2f}K" if n >= 1e3 else str(n)


def _config_info(cfg: Any, arch: str, count: int) -> dict[str, Any]:
    """Ollama's model_info keys for the shape, GGUF-style (`<arch>.<key>`)."""
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": count}
    for key, attr in (
        ("context_length", "max_position_embeddings"),
        ("embedding_length", "hidden_size"),
        ("block_count", "num_layers"),
        ("feed_forward_length", "intermediate_size"),
        ("attention.head_count", "num_heads"),
        ("attention.head_count_kv", "num_kv_heads"),
        ("attention.key_length", "head_dim"),
        ("rope.freq_base", "rope_theta"),
        ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
        ("vocab_size", "vocab_size"),
        ("expert_count", "num_experts"),
        ("expert_used_count", "num_experts_per_tok"),
    ):
        value = getattr(cfg, attr, None)
        if value:
            info[f"{arch}.{key}"] = value
    return info


def _gguf_info(path: Path) -> tuple[dict[str, Any], str]:
    """A GGUF's key/values as model_info (its arrays as null, as Ollama shows them unless verbose) and
    its quantization level."""
    meta = read_gguf_header(path, with_tensors=False).metadata
    info: dict[str, Any] = {}
    for key, value in meta.items():
        if key == "tokenizer.chat_template":
            continue  # shown as the template
        if isinstance(value, (list, np.ndarray)):
            info[key] = None
        elif isinstance(value, np.generic):
            info[key] = value.item()
        else:
            info[key] = value
    return info, FILE_TYPES.get(int(meta.get("general.file_type", -1)), "unknown")


def _weights(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return [path]


def describe(model_config: Any, tokenizer: Any, model_root: str | None) -> ModelFacts:
    """The facts Ollama's listing shows. model_root: what the server was started with (--model); None or
    a path that is not there: only what the config says."""
    arch = str(getattr(model_config, "architecture", "llama"))
    count = parameter_count(model_config)
    info = _config_info(model_config, arch, count)
    fmt, quant, size, mtime = "unknown", "unknown", 0, 0.0
    path = None
    if model_root is not None:
        try:
            path = resolve_model_path(model_root)
        except InputError:
            path = None
    if path is not None:
        files = _weights(path)
        size = sum(f.stat().st_size for f in files)
        mtime = max(f.stat().st_mtime for f in files)
        if path.is_dir():
            fmt = "safetensors"
            config = (
                json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
            )
            quant = TORCH_DTYPES.get(str(config.get("torch_dtype")), "unknown")
        else:
            fmt = "gguf"
            try:
                gguf_info, quant = _gguf_info(path)
                info = {**gguf_info, **{k: v for k, v in info.items() if k not in gguf_info}}
            except InputError as e:  # a file the engine loaded is readable; say so if not, and go on
                logger.warning("cannot read %s for /api/show: %s", path, e)
    # Ollama's digest names its manifest, not a blob; this one names the weights' path, size and time
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    details = OllamaModelDetails(
        format=fmt, family=arch, families=[arch], parameter_size=human_count(count), quantization_level=quant
    )
    template = getattr(tokenizer, "chat_template", None) or ""
    return ModelFacts(size, digest, rfc3339(mtime), details, info, template)
