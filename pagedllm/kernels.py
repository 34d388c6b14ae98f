"""The project's C++ CPU kernels: which source each is, which tier it is built for, and one loader.

Sources live beside the Python that uses them (csrc/ folders); this table is the one list of them, so
`pagedllm build-kernels` and `pagedllm env` see every kernel and a process builds each once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pagedllm import platform
from pagedllm.cpp_extension import is_built, load_cpp_extension

_ROOT = Path(__file__).parent


@dataclass(frozen=True)
class Kernel:
    module: str  # the extension's base name
    source: str  # relative to the package
    what: str
    min_tier: str | None = None  # None: built for whatever tier this process runs at, "none" included
    fixed_tier: str | None = None  # built with exactly this tier's flags (runs on every tier above it)

    @property
    def path(self) -> Path:
        return _ROOT / self.source

    def tier(self) -> str | None:
        """The tier this process builds it for, or None when the CPU (or the cap) is below what it needs."""
        caps = platform.capabilities()
        if self.min_tier is not None and not caps.at_least(self.min_tier):
            return None
        return self.fixed_tier or caps.tier


KERNELS: dict[str, Kernel] = {
    "layer_ops": Kernel(
        "pagedllm_layer_ops",
        "model/layers/csrc/layer_ops.cpp",
        "RMSNorm, add + RMSNorm, SiLU-and-mul, rotary",
    ),
    "paged_decode": Kernel(
        "pagedllm_paged_decode", "attention/csrc/paged_decode.cpp", "paged decode attention, K/V write"
    ),
    "greedy": Kernel("pagedllm_greedy", "worker/csrc/greedy.cpp", "argmax of a greedy batch's logits"),
    "woq_avx2": Kernel(
        "pagedllm_woq_avx2",
        "quantization/csrc/woq_avx2.cpp",
        "4/8-bit weight-only matmul with int8 activations (AVX2 + FMA; AVX512-VNNI from avx512_bf16)",
        min_tier="avx2",  # built for this process's tier: VPDPBUSD where the tier has it, same results
    ),
    "woq_amx": Kernel(
        "pagedllm_woq_amx",
        "quantization/csrc/woq_amx.cpp",
        "4/8-bit weight-only matmul on AMX tiles, int8 (VNNI) gemv for 1-8 rows",
        min_tier="amx",
        fixed_tier="amx",
    ),
    "lora": Kernel(
        "pagedllm_lora",
        "lora/csrc/lora.cpp",
        "each row's LoRA adapter product added in place: its slot's A, then each slice's block of B",
    ),
    "decode_stack": Kernel(
        "pagedllm_decode_stack",
        "model/csrc/decode_stack.cpp",
        "every decoder layer of a decode step in one call (AVX2-layout linears; at amx also AMX-layout and "
        "prepacked bf16 ones)",
        min_tier="avx2",  # built for this process's tier: the amx tier's build includes the AMX kernels
    ),
}


@cache
def load(name: str):
    """The compiled kernel module, or None where it cannot run here (tier, no compiler, missing source)."""
    kernel = KERNELS[name]
    tier = kernel.tier()
    if tier is None or not kernel.path.is_file():
        return None
    return load_cpp_extension(kernel.module, kernel.path, tier=tier)


def state(name: str) -> str:
    """ "built", "not built yet" or why it does not apply here (for `pagedllm env`)."""
    kernel = KERNELS[name]
    tier = kernel.tier()
    if tier is None:
        return f"not for this tier (needs {kernel.min_tier})"
    if not kernel.path.is_file():
        return "source missing"
    return "built" if is_built(kernel.module, kernel.path, tier) else "not built yet"
