"""From a checkpoint path to a ready model: load weights, build the decoder, quantize if asked."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_checkpoint


def build_model(
    path: Path, dtype: torch.dtype, quantization: str | None = None, show_progress: bool = True
) -> tuple[LlamaForCausalLM, ModelConfig]:
    ckpt = load_checkpoint(path, show_progress=show_progress)
    model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, dtype)
    if quantization is not None:
        from pagedllm.errors import InputError

        raise InputError(f"quantization {quantization!r} is not supported yet", param="quantization")
    return model, ckpt.config
