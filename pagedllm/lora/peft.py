"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), read and checked against the base.

Every refusal is an InputError naming what is wrong (a missing file, a rank above max_lora_rank, a target
module the model lacks, a weight of another base's shape, an embed_tokens / lm_head adapter), so a server
refuses the folder and serves on. The scaling (lora_alpha / r, or / sqrt(r) with use_rslora) is folded
into B here, once, so the batched product (punica.py) is two plain matmuls.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# the decoder linears an adapter may target (PEFT's module names)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# modules outside the decoder linears: their adapters change the vocabulary side, which the batched
# product does not cover (vLLM refuses them too)
REFUSED_TARGETS = ("embed_tokens", "lm_head")
# adapter_config.json options that change the math beyond A, B and one scale: refused, not ignored
_UNSUPPORTED = {
    "use_dora": lambda v: bool(v),
    "modules_to_save": lambda v: bool(v),
    "rank_pattern": lambda v: bool(v),
    "alpha_pattern": lambda v: bool(v),
    "fan_in_fan_out": lambda v: bool(v),
    "bias": lambda v: v not in (None, "none"),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of a decoder layer."""
    d, q, kv, f = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, module) -> (A [r, in], B scaled [out, r]), float32 on the CPU."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def _bad(message: str) -> InputError:
    return InputError(message, param="lora_path")


def read_adapter_config(path: Path) -> dict:
    if not path.is_dir():
        raise _bad(f"LoRA adapter folder {str(path)!r} does not exist")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise _bad(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise _bad(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not readable JSON ({e})") from None
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _bad(f"LoRA adapter {str(path)!r} is a {peft_type} adapter; only LORA is served")
    for key, unsupported in _UNSUPPORTED.items():
        if unsupported(config.get(key)):
            raise _bad(f"LoRA adapter {str(path)!r}: {key}={config[key]!r} is not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for name in REFUSED_TARGETS:
        if any(name == t or name in t for t in targets):
            raise _bad(
                f"LoRA adapter {str(path)!r} targets {name}: embed_tokens / lm_head adapters are not supported"
            )
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for file in WEIGHTS_FILES:
        if (path / file).is_file():
            if file.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path / file))
            return torch.load(path / file, map_location="cpu", weights_only=True)
    raise _bad(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILES[0]}")


def load_adapter(
    path: str | Path, lora_name: str, lora_int_id: int, cfg: ModelConfig, max_rank: int
) -> LoRAAdapter:
    """Read and check a PEFT folder for a base of config `cfg`; InputError naming the first problem."""
    path = Path(path)
    config = read_adapter_config(path)
    tensors = _read_weights(path)
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if any(name in key for name in REFUSED_TARGETS):
            raise _bad(
                f"LoRA adapter {str(path)!r} has weights for {key}: embed_tokens / lm_head adapters are not supported"
            )
        m = _KEY.search(key)
        if m is None:
            raise _bad(f"LoRA adapter {str(path)!r}: weight {key!r} is not a LoRA A/B of a decoder linear")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise _bad(
                f"LoRA adapter {str(path)!r} targets {module!r}, which this model does not have (it has {', '.join(TARGETS)})"
            )
        if layer >= cfg.num_layers:
            raise _bad(
                f"LoRA adapter {str(path)!r} has weights for layer {layer}; the model has {cfg.num_layers} layers"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise _bad(f"LoRA adapter {str(path)!r} has no LoRA weights")
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise _bad(f"LoRA adapter {str(path)!r} has rank {rank}, above max_lora_rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoRAAdapter(lora_name, lora_int_id, str(path), rank, scaling)
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _bad(
                f"LoRA adapter {str(path)!r}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}"
            )
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise _bad(
                f"LoRA adapter {str(path)!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"this model needs ({rank}, {fan_in}) and ({fan_out}, {rank}) (an adapter of another base?)"
            )
        adapter.weights[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return adapter
