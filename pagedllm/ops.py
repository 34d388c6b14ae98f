"""The named ops of the model and the one place that picks, loads and hands out each op's implementation.

Every fast operation the model runs has a torch reference (backend "torch") and, where this machine has
one, a backend: a C++ kernel built for the CPU tier, oneDNN, the AMX unit. `select` chooses one per op
from the capability set (platform.py) and the kernels that built (kernels.py), once a process: the engine
calls `table()` at start-up, which builds every kernel it picks before the first request. Call sites ask
`kernel(op)` for the implementation (the loaded C++ module, or None where the reference runs) and never
load a kernel themselves, so `forced(op="torch")` really runs the reference of any op. `pagedllm env`
prints the table.

Ops (the code that dispatches on them):
    layer_ops         RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul (model/layers)
    attention_decode  decode attention over the paged cache (attention/paged.py)
    write_kv          new K/V into their cache slots (attention/paged.py)
    attention_prefill prompt attention: torch SDPA, or the eager formula as the reference (attention/paged.py)
    linear            dense bf16 / fp32 linears: prepacked for oneDNN at build, or F.linear (model/fuse.py)
    quantized_linear  4/8-bit weight-only linears: GGUF blocks, RTN, GPTQ, AWQ (quantization/woq_kernels.py)
    argmax            greedy sampling of a whole batch (worker/sampler.py)
    decoder_stack     all decoder layers of a decode step in one fused call, or the model's layer loop
                      (model/decode_stack.py; whether a model can take it is decided with the model)
    lora              every row's LoRA adapter product added to its linear's output, all adapters and rows
                      of a linear in one call (lora/punica.py; C++ in lora/csrc/lora.h, also called by the
                      decoder stack)

Batch invariance (--batch-invariant, vLLM's VLLM_BATCH_INVARIANT): an engine built with it gives a request the
same numbers, so the same greedy tokens, whatever else is in its steps (alone, in a batch, chunked, after a
cached prefix, recomputed after a preemption, verifying drafts, on a data-parallel replica). Its choices are
made here (`BATCH_INVARIANT`, `ROW_INVARIANT_QUANTIZED_KERNELS`) and read where kernels are chosen:
`batch_invariant()` is in force while such an engine's model is built (woq_kernels.choose then keeps to the
row-invariant kernels), and its model runner feeds every token as a decode row (worker/model_runner.py), so
attention is the decode kernel's for every query row and every step takes the same decoder path.
worker/batch_invariant.py names what a built model would still compute differently by batch (a dense linear,
a kernel not in the list, the torch decode); the engine refuses it, naming it.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from types import ModuleType

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
    "lora",
)
REFERENCE = "torch"  # every op's reference backend: plain torch, what every other backend is tested against
# quantized_linear's backends and the kernels each reads (woq_kernels.py): at the amx tier the AMX kernels
# take bf16 activations and the AVX2 one float32; "torch-packed" is torch's int4/int8 kernels, no C++
QUANTIZED_LINEAR_KERNELS = {"amx": ("woq_amx", "woq_avx2"), "avx2": ("woq_avx2",), "torch-packed": ()}
# quantized-linear kernels (woq_kernels.py names) whose result for a row does not depend on the other rows of
# the call: the AVX2 kernel rounds each row to int8 on its own and sums each output in one fixed order (its
# 32-blocks in turn, whatever kRows block the row falls in), and threads split output columns, never a sum.
# Not "amx" (int8 dot products for 1-8 rows, bf16 AMX tiles above: two roundings of x), not "torch-packed"
# (its own kernel up to 48/64 rows, the weight dequantized for F.linear above).
ROW_INVARIANT_QUANTIZED_KERNELS = ("avx2",)
# What --batch-invariant runs for each op whose choice it changes, and why (`pagedllm env` prints it)
BATCH_INVARIANT = {
    "quantized_linear": "the avx2 kernel for every row count (at the amx tier too: no 1-8 row dot products "
    "there); a linear it does not take is refused",
    "attention_decode": "the C++ decode kernel for every query row, prompts' and verified drafts' included "
    "(each row alone over its context through the block table); the torch decode (padded to the batch's "
    "longest context) is refused",
    "attention_prefill": "not used: prompt rows run as decode rows",
    "decoder_stack": "every step is decode rows, so every step takes the same path (the fused stack where it "
    "was built, else the layer loop)",
    "linear": "dense linears are refused (oneDNN / MKL choose their blocking by the row count)",
}


@dataclass(frozen=True)
class Choice:
    op: str
    backend: str  # "torch" is the reference; anything else names what runs
    detail: str  # what runs and why, for `pagedllm env` and the start-up log
    kernels: tuple[str, ...] = ()  # the kernels.KERNELS entries the backend calls, the first its main one


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


def _usable(kernel: str, caps: platform.Capabilities) -> bool:
    """The kernel is for a tier `caps` has (not only this process's), it builds here, and it runs (the
    AMX one asks the OS for the tile state)."""
    need = kernels.KERNELS[kernel].min_tier
    if need is not None and not caps.at_least(need):
        return False
    module = kernels.load(kernel)
    return module is not None and getattr(module, "available", lambda: True)()


def select(caps: platform.Capabilities) -> dict[str, Choice]:
    """Each op's implementation on this machine (builds the kernels it needs to know that they load)."""
    tier = caps.tier
    vec = "16 lanes at a time with AVX-512" if caps.at_least("avx512") else f"loops compiled for {tier}"
    out: dict[str, Choice] = {}

    def pick(op: str, kernel: str, backend: str, detail: str, reference: str) -> None:
        if _usable(kernel, caps):
            out[op] = Choice(op, backend, detail, (kernel,))
        else:
            out[op] = Choice(op, REFERENCE, reference)

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
        "attention_prefill", "sdpa", "scaled_dot_product_attention (causal, GQA), one prompt at a time"
    )
    if caps.native_bf16 and prepacking_available():
        out["linear"] = Choice(
            "linear", "onednn-prepacked", "bf16 weights reordered once for oneDNN at build; fp32: MKL"
        )
    else:
        out["linear"] = Choice(
            "linear", REFERENCE, "F.linear (MKL sgemm for fp32, ATen's bf16 gemm for bf16)"
        )
    if all(_usable(k, caps) for k in QUANTIZED_LINEAR_KERNELS["amx"]):
        out["quantized_linear"] = Choice(
            "quantized_linear",
            "amx",
            "bf16: int8 (VNNI) dot products for 1-8 rows, AMX tiles above; fp32: the avx2 kernel",
            QUANTIZED_LINEAR_KERNELS["amx"],
        )
    elif _usable("woq_avx2", caps):
        out["quantized_linear"] = Choice(
            "quantized_linear",
            "avx2",
            "int8 activations x 4/8-bit codes (AVX2 maddubs), any rows, fp32 or bf16",
            QUANTIZED_LINEAR_KERNELS["avx2"],
        )
    else:
        out["quantized_linear"] = Choice(
            "quantized_linear",
            "torch-packed",
            "torch's int4/int8 packed kernels for small bf16 batches, else the weight dequantized per call",
        )
    pick("argmax", "greedy", f"cpp-{tier}", "first maximum of each row in one pass", "torch max(dim)")
    # built for this tier from avx2 up; below amx it serves only the AVX2 kernel's layout, so it is
    # chosen there only where that kernel loads. Whether a model can take it is asked with the model
    # (decode_stack.supports; `pagedllm env --model M`).
    if out["quantized_linear"].backend in ("amx", "avx2") and _usable("decode_stack", caps):
        amx = out["quantized_linear"].backend == "amx"
        out["decoder_stack"] = Choice(
            "decoder_stack",
            "fused-amx" if amx else "fused-avx2",
            "decode steps and fresh prefills in one C++ call, for models whose every decoder linear it can "
            + (
                "call (AMX-layout, AVX2-layout or prepacked bf16)"
                if amx
                else "call (AVX2-layout, fp32 or bf16)"
            ),
            ("decode_stack",),
        )
    else:
        out["decoder_stack"] = Choice("decoder_stack", REFERENCE, "the model's layer loop, each op as above")
    pick(
        "lora",
        "lora",
        f"cpp-{tier}",
        "each row through its own slot's A and each slice's block of B, added in place (one call a linear)",
        "masked stacked shrink and expand: two F.linear calls per linear for every adapter's rows",
    )
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
# True inside batch_invariant() (per thread: an engine built on another thread meanwhile is not affected)
_batch_invariant_build: ContextVar[bool] = ContextVar("batch_invariant_build", default=False)


@contextmanager
def batch_invariant():
    """In force while a --batch-invariant engine's model is built: the build-time choices (a quantized
    linear's kernel, woq_kernels.choose) keep to the kernels whose row results do not depend on the batch."""
    token = _batch_invariant_build.set(True)
    try:
        yield
    finally:
        _batch_invariant_build.reset(token)


def building_batch_invariant() -> bool:
    """Whether a --batch-invariant model is being built (inside batch_invariant())."""
    return _batch_invariant_build.get()


_kernel_cache: dict[tuple[str, str | None], ModuleType | None] = {}  # (op, name) -> module, unforced


def backend(op: str) -> str:
    """The backend chosen for `op` ("torch" = the reference implementation)."""
    return _forced.get(op) or table()[op].backend


def kernel(op: str, name: str | None = None) -> ModuleType | None:
    """The C++ module that implements `op` here (its kernel `name`, where the backend calls several), or
    None where the torch reference runs: no kernel for this tier, or inside forced(op="torch"). Called on
    every op call, so it is two dict look-ups."""
    if _forced:
        forced_backend = _forced.get(op)
        if forced_backend is not None and forced_backend != table()[op].backend:
            return _forced_kernel(op, forced_backend, name)
    key = (op, name)
    if key not in _kernel_cache:
        _kernel_cache[key] = _load_named(table()[op].kernels, name)
    return _kernel_cache[key]


def _load_named(names: tuple[str, ...], name: str | None) -> ModuleType | None:
    """Kernel `name` (the first, without one) if it is among a backend's kernels, loaded; else None."""
    wanted = name or (names[0] if names else None)
    return kernels.load(wanted) if wanted in names else None


def any_forced(names: tuple[str, ...]) -> bool:
    """Whether any of these ops runs on another backend than the table's (inside ops.forced)."""
    return bool(_forced) and any(_forced.get(op, table()[op].backend) != table()[op].backend for op in names)


def _forced_kernel(op: str, forced_backend: str, name: str | None) -> ModuleType | None:
    if forced_backend == REFERENCE or op != "quantized_linear":
        return None
    return _load_named(QUANTIZED_LINEAR_KERNELS[forced_backend], name)


def _check_forcible(op: str, value: str) -> None:
    """The reference, the table's own choice, or (quantized_linear) another backend whose kernels run here."""
    if value in (REFERENCE, table()[op].backend):
        return
    if op == "quantized_linear" and value in QUANTIZED_LINEAR_KERNELS:
        caps = platform.capabilities()
        if all(_usable(k, caps) for k in QUANTIZED_LINEAR_KERNELS[value]):
            return
        raise ValueError(f"quantized_linear backend {value!r} cannot run here (its kernels do not load)")
    raise ValueError(
        f"{op} cannot be forced to {value!r}: use {REFERENCE!r} (the reference) or {table()[op].backend!r}"
    )


@contextmanager
def forced(**backends: str):
    """Run ops on other backends inside the block, e.g. forced(quantized_linear="torch") for the
    reference: tests compare a kernel against it, and check the reference's own exactness, on any CPU.
    What is decided at build time (prepacking, a layer's quantized kernel, the fused stack) follows the
    backends in force while the model is built; per-call ops follow them call by call."""
    unknown = set(backends) - set(OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; ops are {', '.join(OPS)}")
    for op, value in backends.items():
        _check_forcible(op, value)
    saved = dict(_forced)
    _forced.update(backends)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
