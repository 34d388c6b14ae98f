"""The named ops of the model and the one place that picks each op's implementation.

Every fast operation the model runs has a torch reference ("torch") and, where this machine has one,
a backend (a C++ kernel built for the CPU tier, oneDNN, the AMX unit). `select` chooses one per op from
the capability set (platform.py) and the kernels that built (kernels.py), once a process: the engine calls
`table()` at start-up, which builds every kernel it picks before the first request, and the layers ask
`backend(op)` instead of probing the hardware themselves. `pagedllm env` prints the table.

Ops (the layers that dispatch on them):
    layer_ops         RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul (model/layers)
    attention_decode  decode attention over the paged cache (attention/paged.py)
    write_kv          new K/V into their cache slots (attention/paged.py)
    attention_prefill prompt attention (torch SDPA on every tier)
    linear            dense bf16 / fp32 linears (model/fuse.py)
    quantized_linear  4/8-bit weight-only linears: GGUF blocks, RTN, GPTQ, AWQ (quantization/linear.py)
    argmax            greedy sampling of a whole batch (worker/sampler.py)
    decoder_stack     all decoder layers of a decode step in one fused call, or the per-op layer loop
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

from pagedllm import kernels, platform

logger = logging.getLogger("pagedllm")

OPS = (
    "layer_ops",
    "attention_decode",
    "write_kv",
    "attention_prefill",
    "linear",
    "quantized_linear",
    "argmax",
    "decoder_stack",
)


@dataclass(frozen=True)
class Choice:
    op: str
    backend: str  # "torch" is the reference; anything else names the kernel that runs
    detail: str  # what runs and why, for `pagedllm env` and the start-up log


@cache
def prepacking_available() -> bool:
    """oneDNN with the prepacked-linear ops (x86 builds of torch); probed once with a tiny matrix. On CPUs
    without native bf16 oneDNN refuses bf16 (False), and ATen's own bf16 gemm runs instead."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 16, dtype=torch.bfloat16), packed, None, "none", [], ""
        )
        return bool((y == 16).all())
    except (RuntimeError, AttributeError):
        return False


def select(caps: platform.Capabilities) -> dict[str, Choice]:
    """Each op's implementation on this machine (builds the kernels it needs to know that they load)."""
    tier = caps.tier
    vec = "16 lanes at a time with AVX-512" if caps.at_least("avx512") else f"loops compiled for {tier}"
    out: dict[str, Choice] = {}

    def loads(kernel: str) -> bool:
        """The kernel is for a tier `caps` has (not only this process's) and it builds here."""
        need = kernels.KERNELS[kernel].min_tier
        return (need is None or caps.at_least(need)) and kernels.load(kernel) is not None

    def pick(op: str, kernel: str | None, backend: str, detail: str, fallback: str) -> None:
        if kernel is not None and loads(kernel):
            out[op] = Choice(op, backend, detail)
        else:
            out[op] = Choice(op, "torch", fallback)

    pick(
        "layer_ops",
        "layer_ops",
        f"cpp-{tier}",
        f"one C++ call per op, rounding as torch does (bf16 {vec}; fp32 {vec})",
        "torch ops (no C++ kernel built here)",
    )
    bf16_tasks = "bf16 KV: AVX512-BF16 dot products" if caps.native_bf16 else "bf16 KV: widened to fp32"
    pick(
        "attention_decode",
        "paged_decode",
        f"cpp-{tier}",
        f"reads K/V in place through the block tables ({bf16_tasks}; fp32 KV: {vec})",
        "gathers each context's blocks, one padded SDPA call",
    )
    pick("write_kv", "paged_decode", f"cpp-{tier}", "one call for all new K/V", "index_copy_ per cache")
    out["attention_prefill"] = Choice(
        "attention_prefill", "torch", "scaled_dot_product_attention (causal, GQA), one prompt at a time"
    )
    if caps.native_bf16 and prepacking_available():
        out["linear"] = Choice(
            "linear", "onednn-prepacked", "bf16 weights reordered once for oneDNN; fp32: MKL"
        )
    else:
        out["linear"] = Choice("linear", "torch", "F.linear (MKL sgemm for fp32, ATen's bf16 gemm for bf16)")
    if loads("woq_amx"):
        out["quantized_linear"] = Choice(
            "quantized_linear",
            "amx",
            "bf16: AVX512-BF16 dot products for 1-4 rows, AMX tiles above; fp32: avx2",
        )
    elif loads("woq_avx2"):
        out["quantized_linear"] = Choice(
            "quantized_linear",
            "avx2",
            "int8 activations x 4/8-bit codes (AVX2 maddubs), any rows, fp32 or bf16",
        )
    else:
        out["quantized_linear"] = Choice(
            "quantized_linear",
            "torch",
            "torch's int4/int8 packed kernels for small bf16 batches, else the weight dequantized per call",
        )
    pick("argmax", "greedy", f"cpp-{tier}", "first maximum of each row in one pass", "torch max(dim)")
    # built for this tier from avx2 up; below amx it serves only the AVX2 kernel's layout, so it is
    # built there only where that kernel loads
    wants_stack = caps.at_least("amx") or loads("woq_avx2")
    stack = kernels.load("decode_stack") if wants_stack and loads("decode_stack") else None
    if stack is not None and getattr(stack, "amx", True) and caps.at_least("amx"):
        out["decoder_stack"] = Choice(
            "decoder_stack",
            "fused-amx",
            "decode steps and fresh prefills in one C++ call (bf16 AMX-layout or prepacked; AVX2 layout)",
        )
    elif stack is not None:
        out["decoder_stack"] = Choice(
            "decoder_stack",
            "fused-avx2",
            "decode steps and fresh prefills in one C++ call (AVX2-layout linears, fp32 or bf16)",
        )
    else:
        out["decoder_stack"] = Choice("decoder_stack", "per-op", "the model's layer loop, each op as above")
    return out


@cache
def table() -> dict[str, Choice]:
    """This process's op table, chosen once."""
    caps = platform.capabilities()
    chosen = select(caps)
    logger.info(
        "CPU tier %s%s: %s",
        caps.tier,
        " (capped by PAGEDLLM_CPU_ISA)" if caps.capped_by_env else "",
        ", ".join(f"{c.op}={c.backend}" for c in chosen.values()),
    )
    return chosen


_forced: dict[str, str] = {}


def backend(op: str) -> str:
    """The backend chosen for `op` ("torch" = the reference implementation)."""
    return _forced.get(op) or table()[op].backend


@contextmanager
def forced(**backends: str):
    """Run ops on other backends inside the block, e.g. forced(quantized_linear="torch") for the
    reference: tests compare a kernel against it, and check the reference's own exactness, on any CPU."""
    unknown = set(backends) - set(OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; ops are {', '.join(OPS)}")
    saved = dict(_forced)
    _forced.update(backends)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
