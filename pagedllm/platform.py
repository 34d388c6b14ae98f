"""What this machine can run: the device and, on x86 CPUs, the instruction-set tier the kernels are built for.

Tiers, lowest first; each includes the ones before it:
    avx2         AVX2 + FMA + F16C (AMD Zen 2/3, Intel Haswell and later: most cloud VMs and laptops)
    avx512       + AVX-512 F/BW/VL/DQ
    avx512_bf16  + AVX-512 BF16 (native bf16 dot products: AMD Zen 4/5, Intel Cooper Lake and later)
    amx          + AMX tiles with bf16 (Intel Sapphire Rapids and later)

The tier is detected once from /proc/cpuinfo. `PAGEDLLM_CPU_ISA=avx2|avx512|avx512_bf16|amx` caps it, so a
lower tier's kernels run (and are tested) on a higher CPU; a cap above what the CPU has is refused, since
its kernels would fault. A CPU below avx2 gets the tier "none": every op then runs its torch reference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform as _platform
from dataclasses import dataclass, field
from functools import cache

from pagedllm.errors import InputError

TIERS = ("avx2", "avx512", "avx512_bf16", "amx")
ISA_ENV = "PAGEDLLM_CPU_ISA"

# the /proc/cpuinfo flags each tier needs, on top of the tier below it
_TIER_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),  # every AVX512-BF16 CPU has VNNI too
    "amx": ("amx_tile", "amx_bf16"),
}
# the compiler flags a kernel of each tier is built with (never -march=native: a cache shared by two
# machines, or a capped run, must not get instructions the tier does not have)
_TIER_CFLAGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}


@dataclass(frozen=True)
class Capabilities:
    """The capability set the op table is chosen from (ops.py), once at engine start."""

    device: str  # "cpu" (later "cuda")
    cpu_model: str
    flags: frozenset[str] = field(repr=False)
    detected_tier: str  # what the CPU has
    tier: str  # what the kernels are built for: detected_tier, or lower under PAGEDLLM_CPU_ISA
    capped_by_env: bool = False

    def at_least(self, tier: str) -> bool:
        """Whether the chosen tier includes `tier` ("none" includes nothing)."""
        return self.tier != "none" and TIERS.index(self.tier) >= TIERS.index(tier)

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware: only there is bf16 compute faster than float32."""
        return self.at_least("avx512_bf16")


def cflags(tier: str) -> list[str]:
    """Compiler flags for a kernel of `tier`: every tier up to it."""
    if tier == "none":
        return []
    return [f for t in TIERS[: TIERS.index(tier) + 1] for f in _TIER_CFLAGS[t]]


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = _platform.processor() or _platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", _platform.machine(), _platform.processor()):
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if flags and key == "model name":
                    break
    except OSError:
        pass
    return model, flags


def tier_of(flags: frozenset[str]) -> str:
    """The highest tier whose flags (and every lower tier's) are all present."""
    best = "none"
    for tier in TIERS:
        if not all(f in flags for f in _TIER_FLAGS[tier]):
            break
        best = tier
    return best


def check_isa_cap(value: str, detected: str) -> str:
    """PAGEDLLM_CPU_ISA's value as a tier at or below `detected`, or an InputError naming the limit."""
    if value not in TIERS:
        raise InputError(f"{ISA_ENV} must be one of {', '.join(TIERS)}; got {value!r}", param=ISA_ENV)
    if detected == "none" or TIERS.index(value) > TIERS.index(detected):
        raise InputError(
            f"{ISA_ENV}={value} is above this CPU's tier ({detected}): its kernels would not run here",
            param=ISA_ENV,
        )
    return value


@cache
def capabilities() -> Capabilities:
    """This process's capability set (read once: the op table and the kernel builds must agree)."""
    model, flags = _read_cpuinfo()
    detected = tier_of(flags) if _platform.machine() in ("x86_64", "AMD64") else "none"
    cap = os.environ.get(ISA_ENV, "").strip()
    tier = check_isa_cap(cap, detected) if cap else detected
    return Capabilities(
        device="cpu",
        cpu_model=model,
        flags=flags,
        detected_tier=detected,
        tier=tier,
        capped_by_env=bool(cap) and tier != detected,
    )


@cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # no C library to load: nothing to trim
        return None


def release_free_heap() -> None:
    """Return the heap's free memory to the OS (glibc's malloc_trim; a no-op elsewhere). glibc keeps freed
    blocks below its mmap threshold, which grows to 32 MB after the first big free, so building a model
    (decoding blocks, merging layers: transients of tens of MB each) left ~800 MB of free heap resident for
    a 1B GGUF file. Cheap (milliseconds): called between the steps of a load."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
