"""--batch-invariant: what would still make a request's numbers depend on the rest of its batch.

An engine built with the flag must give a request the same logits, so the same greedy tokens, alone, in a
batch of any size, with its prompt chunked or partly cached, recomputed after a preemption, verifying
speculative drafts, or on one data-parallel replica of several. Its runner feeds every token as a decode row
(model_runner.py), so no step has prefill attention or a second decoder path; what is left is that every op
gives a row the same result whatever the other rows are (ops.py's BATCH_INVARIANT): the per-row layer ops,
the C++ decode attention (one task per sequence and KV head, summed in position order), the greedy argmax,
and quantized linears on a kernel of ops.ROW_INVARIANT_QUANTIZED_KERNELS. The functions here name what an
engine asks for that is not on that list; the engine refuses it with that name (InputError), never runs
it silently.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm import ops
from pagedllm.model.layers.packed_linear import PackedLinear
from pagedllm.quantization.linear import QuantLinear

PARAM = "batch_invariant"
EMBEDDING = "model.embed_tokens"  # LlamaForCausalLM's token embedding


def engine_problem(
    tensor_parallel_size: int, quantization: str | None, kv_cache_dtype, dtype: torch.dtype
) -> str | None:
    """What an engine's options ask for that the mode cannot make invariant, known before the model
    loads, or None. quantization: the resolved one (None: dense linears); kv_cache_dtype: the resolved one
    (a torch dtype, or "int8" / "fp8")."""
    if tensor_parallel_size > 1:
        return (
            f"tensor_parallel_size {tensor_parallel_size}: the ranks' partial products are summed by the "
            "backend's all-reduce (gloo, nccl), whose order this mode does not control (ring algorithms cut "
            "the buffer by its size, so by the batch)"
        )
    if quantization is None:
        return (
            "dense linears (quantization none, or a float checkpoint): oneDNN and MKL choose their blocking, "
            "so a row's summation order, by the row count; serve the model quantized (a GGUF from its blocks: "
            "quantization auto or gguf; or int8 / int4)"
        )
    return attention_problem(kv_cache_dtype, dtype)


def attention_problem(kv_cache_dtype, dtype: torch.dtype) -> str | None:
    """Why decode attention would depend on the batch with this cache here (the C++ kernel reads each row
    alone; the torch decode pads every row to the batch's longest context), or None."""
    if kv_cache_dtype != dtype:
        name = str(kv_cache_dtype).removeprefix("torch.")
        return (
            f"kv_cache_dtype {name} under {str(dtype).removeprefix('torch.')} compute: the C++ decode kernel "
            "reads a cache in the compute dtype only, and the torch decode pads every row to the batch's "
            "longest context"
        )
    if ops.kernel("attention_decode") is None:
        return (
            f"attention_decode={ops.backend('attention_decode')} (no C++ decode kernel here): the torch decode "
            "pads every row to the batch's longest context"
        )
    return None


def model_problem(model: nn.Module) -> str | None:
    """The first linear of a built model whose result for a row depends on the other rows of its call, or
    None: a dense one (nn.Linear, oneDNN's PackedLinear) or a quantized one on a kernel not in
    ops.ROW_INVARIANT_QUANTIZED_KERNELS (or the dequantizing reference). The token embedding is a lookup
    (its quantized table, if any, gives rows one by one), so what it holds is not a linear here; a table
    that is the tied lm_head too is checked under that name."""
    for name, module in model.named_modules(remove_duplicate=False):
        if name == EMBEDDING or name.startswith(EMBEDDING + "."):
            continue
        if isinstance(module, QuantLinear):
            kernel = module.kernel.name if module.kernel is not None else "the torch reference (F.linear)"
            if kernel not in ops.ROW_INVARIANT_QUANTIZED_KERNELS:
                return (
                    f"{name} on {kernel}, whose result for a row depends on the row count (row-invariant "
                    f"quantized kernels: {', '.join(ops.ROW_INVARIANT_QUANTIZED_KERNELS)}, which takes 4- and "
                    "8-bit codes in groups of 32, or 16 for 8-bit, on CPUs from avx2 up)"
                )
        elif isinstance(module, (nn.Linear, PackedLinear)):
            return f"{name}, a dense linear (oneDNN / MKL choose their blocking by the row count)"
    return None
