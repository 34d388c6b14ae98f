"""A quantized model as a Hugging Face style folder, and back.

    out/config.json          the source's config (or one written from a GGUF's metadata) plus
                             "quantization_config": {"quant_method": "pagedllm", "bits", "group_size",
                                                      "method": "rtn" | "awq" | "gptq"}
    out/model.safetensors    per quantized linear NAME (e.g. model.layers.0.self_attn.q_proj):
                               NAME.qweight  uint8 [out, in/2] (bits <= 4: two codes a byte, low nibble
                                             first, pack.py) or [out, in]
                               NAME.scales   float32 [out, groups]   (groups = in / group_size, or 1)
                               NAME.zeros    int32 [out, groups]     w = scales * (qweight - zeros)
                               NAME.bias     when the layer has one
                             everything else under its usual name, in the dtype it had when saved
    out/tokenizer files      copied from an HF folder, or written by transformers for a GGUF source

The portable form is uniform.py's (s, integer z); the CPU kernel layouts are rebuilt at load, so a folder
saved on one machine loads on any. GGUF-native layers (Q4_1's min is not a whole number of steps) cannot
be written in this form and are refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.classes import model_class
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import moe, registry
from pagedllm.model.loader.hf_config import read_hf_config
from pagedllm.model.loader.safetensors import safetensors_files
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.model import find_linear
from pagedllm.quantization.pack import unpack_int4

QUANT_METHOD = "pagedllm"
METHODS = ("rtn", "awq", "gptq")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A config.json that read_hf_config turns back into the same ModelConfig."""
    entry = registry.get(config.architecture)
    eos = config.eos_token_ids
    partial = (
        {} if config.rotary_dim is None else {"partial_rotary_factor": config.rotary_dim / config.head_dim}
    )
    return {
        **partial,
        "architectures": [entry.hf_architectures[0]],
        "model_type": entry.hf_model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "layer_types": config.layer_types,
        **_gemma_keys(config),
        **moe.hf_config_keys(config, entry),  # experts, top-k, their width, dense layers
        **({"clip_qkv": config.clip_qkv} if config.clip_qkv is not None else {}),
    }


def _gemma_keys(config: ModelConfig) -> dict[str, Any]:
    """Gemma's config.json keys (read_hf_config reads them for a Gemma architecture only)."""
    if not config.gemma_norms:
        return {}
    keys = {
        "hidden_activation": config.hidden_act,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
    }
    if config.rope_local_theta is not None:
        keys["rope_local_base_freq"] = config.rope_local_theta
    return keys


def integer_zero_points(layer: QuantLinear) -> torch.Tensor:
    """z with mins == -s*z exactly as QuantLinear.from_quantized computes it; InputError when there is none."""
    scales, mins = layer.scales_and_mins()
    s = scales.double()
    z = torch.round(-mins.double() / s)
    if not torch.equal((-s * z).float(), mins):
        raise InputError(
            f"layer {layer.name}: its zero points are not whole numbers (a GGUF-native layer?); "
            "only uniform.py-style codes can be saved",
            param="model",
        )
    return z.to(torch.int32)


def save_quantized(model: LlamaForCausalLM, out: str | Path, source: str | Path, method: str = "rtn") -> Path:
    """Write model (with QuantLinear layers) as a folder; `source` is the checkpoint it came from."""
    if method not in METHODS:
        raise InputError(f"method {method!r} is not one of {', '.join(METHODS)}", param="method")
    out, source = Path(out), Path(source)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not layers:
        raise InputError("the model has no quantized layers to save", param="model")
    kinds = {(m.bits, m.group_size) for m in layers.values()}
    if len(kinds) != 1:
        raise InputError(f"layers mix bits/group sizes {sorted(kinds, key=str)}; one setting only", "model")
    bits, group_size = kinds.pop()
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        tensors[f"{name}.qweight"] = layer.portable_qweight().contiguous()
        tensors[f"{name}.scales"] = layer.scales_and_mins()[0].contiguous()
        tensors[f"{name}.zeros"] = integer_zero_points(layer).contiguous()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.contiguous()
    for name, p in model.named_parameters():  # tied lm_head is the embedding's twin: listed once
        tensors[name] = p.detach().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    if source.is_dir() and (source / "config.json").is_file():
        cfg = json.loads((source / "config.json").read_text())
    else:
        cfg = hf_config_dict(model.config)
    cfg["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "bits": bits,
        "group_size": group_size,
        "method": method,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copied = [f for f in _TOKENIZER_FILES if source.is_dir() and (source / f).is_file()]
    for f in copied:
        shutil.copyfile(source / f, out / f)
    if not copied:
        from pagedllm.model.tokenizer import Tokenizer

        Tokenizer.from_checkpoint(source).hf.save_pretrained(out)
    return out


def read_quantization_config(path: str | Path) -> dict[str, Any] | None:
    """The folder's pagedllm quantization_config, or None for anything else (a file, a float folder)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        qc = json.loads(file.read_text()).get("quantization_config")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    if not qc:
        return None
    if qc.get("quant_method") != QUANT_METHOD:
        raise InputError(
            f"{file}: quantization_config quant_method {qc.get('quant_method')!r} is not supported "
            f"(only {QUANT_METHOD!r}, written by `pagedllm quantize`)",
            param="model",
        )
    return qc


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as e:
            raise InputError(f"truncated or corrupt safetensors file {file}: {e}", param="model") from None
    return tensors


def load_quantized(
    path: str | Path, dtype: torch.dtype, show_progress: bool = True
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from a folder save_quantized wrote: QuantLinear layers + float everything else."""
    path = Path(path)
    qc = read_quantization_config(path)
    if qc is None:
        raise InputError(f"{path} is not a pagedllm quantized folder", param="model")
    config = read_hf_config(path)
    bits, group_size = qc.get("bits"), qc.get("group_size")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise InputError(f"{path}: quantization_config bits {bits!r} is not a width 2..8", param="model")
    tensors = _read_tensors(path)
    with torch.device("meta"):
        shapes = model_class(config)(config)  # where the linears are, and their widths; nothing allocated
    layers = {}
    for name in sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")):
        old = find_linear(shapes, name)
        if old is None:
            raise InputError(f"{path}: {name}.qweight does not belong to a linear layer", param="model")
        try:
            qweight, scales, zeros = (tensors.pop(f"{name}.{k}") for k in ("qweight", "scales", "zeros"))
        except KeyError as e:
            raise InputError(f"{path}: {name} lacks {e.args[0]}", param="model") from None
        bias = tensors.pop(f"{name}.bias", None)
        codes = unpack_int4(qweight, old.in_features) if bits <= 4 else qweight
        s = scales.double()
        layer = QuantLinear.from_codes(
            codes, scales, (-s * zeros.double()).float(), bits, group_size, bias, name
        )
        layer.pack(dtype)
        layers[name] = layer
    weights = {k: v.to(torch.float32) for k, v in tensors.items()}
    model = model_class(config).from_weights(config, weights, dtype, modules=layers)
    return model.eval(), config
