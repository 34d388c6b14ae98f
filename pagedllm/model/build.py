"""From a checkpoint path to a model: load weights, build the decoder, quantize if asked (build_model, a
float or quantized model in the checkpoint's layout, what the quantize CLI and perplexity want), and
on to the one that serves (load_model_for_inference: that, cut to a tensor-parallel rank's share, fused).

quantization (the engine's "auto" is resolved first, resolve_quantization):
  None        the checkpoint's weights in `dtype` (a GGUF is dequantized: `--quantization none`);
              a folder written by `pagedllm quantize` loads its quantized layers as they are
  "int8"      RTN at load, INT8 per output channel
  "int4"      RTN at load, INT4 group-wise along the input, group 32 ("int4-g64", "int4-g128" for others)
  "gguf"      a GGUF file's linears served from their own blocks (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K: gguf_blocks.py)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.model.classes import model_class
from pagedllm.model.fuse import fuse_for_inference
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_checkpoint
from pagedllm.model.quantized_checkpoint import load_quantized, read_quantization_config
from pagedllm.model.tensor_parallel import shard_model
from pagedllm.quantization.gguf_native import (
    NATIVE_TYPES,
    prebuilt_linears,
    serve_gguf_natively,
    unserved,
    unserved_message,
)
from pagedllm.quantization.layout_cache import LayoutCache
from pagedllm.quantization.linear import QuantLinear
from pagedllm.quantization.model import resident_weight_bytes

logger = logging.getLogger(__name__)

# name -> (bits, group size along the input; None = per output channel)
RTN_SCHEMES: dict[str, tuple[int, int | None]] = {
    "int8": (8, None),
    "int4": (4, 32),
    "int4-g32": (4, 32),
    "int4-g64": (4, 64),
    "int4-g128": (4, 128),
}
QUANTIZATION_CHOICES = (*RTN_SCHEMES, "gguf")
ENGINE_QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_CHOICES)


def check_quantization(quantization: str | None, choices: tuple[str, ...] = QUANTIZATION_CHOICES) -> None:
    if quantization is not None and quantization not in choices:
        raise InputError(
            f"quantization {quantization!r} is not supported; use one of {', '.join(choices)} "
            "(or leave it unset)",
            param="quantization",
        )


def resolve_quantization(path: Path, quantization: str | None) -> str | None:
    """The engine's quantization: "auto" (the default) serves a GGUF file from its own blocks where a
    quantized-linear kernel runs on this machine (as llama.cpp does; ops.py's table), and anything else as
    it is stored; "none" (or None) dequantizes a GGUF into the compute dtype; the rest as named."""
    check_quantization(quantization, ENGINE_QUANTIZATION_CHOICES)
    if quantization in (None, "none"):
        return None
    if quantization != "auto":
        return quantization
    from pagedllm import ops

    is_gguf = Path(path).is_file() and Path(path).suffix == ".gguf"
    return "gguf" if is_gguf and ops.backend("quantized_linear") in ("amx", "avx2") else None


def build_model(
    path: Path, dtype: torch.dtype, quantization: str | None = None, show_progress: bool = True
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The checkpoint's model in `dtype`, quantized as asked, in the checkpoint's layout (unfused): what
    the quantizers and perplexity work on. A server's model comes from load_model_for_inference."""
    check_quantization(quantization)
    if Path(path).is_dir() and read_quantization_config(path) is not None:
        if quantization is not None:
            raise InputError(
                f"{path} is already quantized; load it without quantization={quantization!r}",
                param="quantization",
            )
        model, config = load_quantized(path, dtype, show_progress)
    else:
        gguf = quantization == "gguf"
        # a GGUF served from its blocks: the linears of the types a kernel serves are never dequantized
        ckpt = load_checkpoint(
            path, show_progress, keep_quantized=gguf, served_types=NATIVE_TYPES if gguf else ()
        )
        config = ckpt.config
        if gguf and ckpt.format != "gguf":
            raise InputError(
                f"quantization='gguf' needs a GGUF file; {path} is a {ckpt.format} checkpoint",
                param="quantization",
            )
        prebuilt = {}
        if gguf:  # the packed layouts of a big file come from the layout cache after its first load
            cache = LayoutCache.for_file(ckpt.path, dtype)
            prebuilt = prebuilt_linears(ckpt.gguf_tensors, ckpt.weights, config, dtype, cache, show_progress)
            if cache is not None:
                cache.save()
        model = model_class(config).from_weights(config, ckpt.weights, dtype, modules=prebuilt)
        if gguf:
            del ckpt.weights  # float copies of what is about to be replaced (fused and expert tensors)
            served = [*prebuilt, *serve_gguf_natively(model, ckpt.gguf_tensors or {}, config, dtype)]
            logger.info("GGUF: %d linear layers served from their blocks", len(served))
            if rest := unserved(ckpt.gguf_tensors or {}, dtype):
                logger.warning(unserved_message(rest))
        elif quantization is not None:
            from pagedllm.quantization.model import quantize_model

            bits, group_size = RTN_SCHEMES[quantization]
            # quantize the checkpoint's float32 weights, not their dtype-rounded copies in the model
            quantize_model(model, bits, group_size, show_progress=show_progress, source_weights=ckpt.weights)
    if quantization is not None or any(isinstance(m, QuantLinear) for m in model.modules()):
        logger.info("resident weights: %.1f MiB", resident_weight_bytes(model) / 2**20)
    return model, config


def load_model_for_inference(
    path: Path | str,
    dtype: torch.dtype,
    quantization: str | None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    show_progress: bool = True,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model that serves, in the one order that works: load (and quantize), cut to rank `tp_rank`'s
    share when tp_size > 1 (shard_model cuts the checkpoint's q/k/v and gate/up, so it runs before they
    are merged), then fuse (merge, prepack, build the quantized kernels' layouts and the decode stack).

    The config returned is what the rank holds, which sizes its ModelRunner's KV cache: the whole model's
    when tp_size is 1, else the rank's local one (its share of the query and KV heads)."""
    model, config = build_model(Path(path), dtype, quantization, show_progress)
    if tp_size > 1:
        config = shard_model(model, config, tp_rank, tp_size)
    fuse_for_inference(model)
    return model, config
