"""Which class builds a model of each architecture: its registry entry names the class, this maps the name.

A module of its own so that build.py (float checkpoints) and quantized_checkpoint.py (folders written by
`pagedllm quantize`) both build through it without importing each other.
"""

from __future__ import annotations

from pagedllm.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import registry

# registry.Architecture.model_class -> the class; every family is one Llama-family definition today
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"LlamaForCausalLM": LlamaForCausalLM}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds a model of `config`'s architecture (its registry entry names it)."""
    return MODEL_CLASSES[registry.get(config.architecture).model_class]
