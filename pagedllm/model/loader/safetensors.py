"""Hugging Face folders: *.safetensors (one file or sharded with an index) -> float32 weights.

Pickled checkpoints (pytorch_model.bin, *.pt) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.loader import moe
from pagedllm.model.loader.hf_config import check_complete, read_hf_config, split_fused

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# The names the model uses; anything else (rotary inv_freq buffers, vision towers, ...) is skipped.
_WANTED = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight|"
    r"mlp\.(gate|up|down|gate_up)_proj\.weight|"
    r"mlp\.gate\.weight|mlp\.experts\.(\d+\.)?(gate|up|down|gate_up)_proj\.weight|"  # MoE (loader/moe.py)
    r"(input|post_attention|pre_feedforward|post_feedforward)_layernorm\.weight)"
)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: from the shard index if there is one, else all *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{index}: not a valid safetensors index ({e})", param="model") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{index} lists shards that do not exist: {', '.join(missing)}", param="model")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise InputError(
            f"model folder {folder} has only pickled weights ({', '.join(pickled)}): "
            "pickled weights are refused; convert to safetensors",
            param="model",
        )
    raise InputError(f"model folder {folder} has no *.safetensors weights", param="model")


def load_safetensors(
    folder: str | Path, show_progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    folder = Path(folder)
    config = read_hf_config(folder)
    files = safetensors_files(folder)
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(desc=f"loading {folder.name}", unit="tensor", disable=not show_progress, leave=False)
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = moe.hf_name(stored)  # Mixtral's and transformers 5's expert names: the model's
                    if _WANTED.fullmatch(name):
                        weights[name] = f.get_tensor(stored).to(torch.float32).contiguous()
                        bar.update()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise InputError(f"truncated or corrupt safetensors file {file}: {e}", param="model") from None
    bar.close()
    if config.tie_word_embeddings:
        # Some tied checkpoints also store the (identical) lm_head; the model reads embed_tokens.
        weights.pop("lm_head.weight", None)
    # 3-D [experts, out, in] expert tensors first: split_fused would take experts.gate_up_proj for Phi-3's
    moe.split_experts(weights, config, folder)
    split_fused(weights, config, folder)  # Phi-3's qkv_proj and gate_up_proj
    check_complete(weights, config, folder)
    return config, weights
