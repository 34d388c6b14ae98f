"""Model loading: resolve a model name to a path, read its config, load float32 weights with HF names."""

from pagedllm.model.loader.default import (
    Checkpoint,
    default_model_path,
    detect_format,
    load_checkpoint,
    read_model_config,
    resolve_model_path,
)

__all__ = [
    "Checkpoint",
    "default_model_path",
    "detect_format",
    "load_checkpoint",
    "read_model_config",
    "resolve_model_path",
]
