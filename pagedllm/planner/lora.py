"""The memory of LoRA adapters (issue 37), as the engine allocates it (pagedllm/lora/layers.py).

Device slots: every decoder linear holds, for each of max_loras slots, A [n * R, in] and B^T [n * R, out] at
the full --max-lora-rank R (a lower rank is zero-padded), n its slices: 3 for the fused q/k/v, 2 for the
fused gate/up, 1 for o and down; B is dense over the slices (block-diagonal, zeros off the blocks). In
float32, and for a 16-bit model (--dtype bf16 / fp16) a copy in that dtype too (small steps run the float32
one, large ones the 16-bit one). The CPU copies: max_cpu_loras loaded adapters, float32, each at its own rank; counted
at rank R over all seven target modules (the most one can take).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InputError


@dataclass(frozen=True)
class LoRAShape:
    num_layers: int
    hidden_size: int
    q_width: int  # num_heads * head_dim
    kv_width: int  # num_kv_heads * head_dim
    intermediate_size: int


def slot_elements(shape: LoRAShape, rank: int) -> int:
    """Elements of one device slot over the whole model (A and B of every linear)."""
    d, q, kv, f, r = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size, rank
    per_layer = (
        3 * r * d + (q + 2 * kv) * 3 * r  # qkv: A [3R, d], B [q + 2kv, 3R]
        + r * q + d * r  # o
        + 2 * r * d + 2 * f * 2 * r  # gate_up: A [2R, d], B [2f, 2R]
        + r * f + d * r  # down
    )  # fmt: skip
    return shape.num_layers * per_layer


def adapter_elements(shape: LoRAShape, rank: int) -> int:
    """Elements of one adapter of rank `rank` over all seven target modules (A [r, in] + B [out, r] each)."""
    d, q, kv, f = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    fans = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    return shape.num_layers * sum(rank * (i + o) for i, o in fans)


def lora_bytes(
    shape: LoRAShape, rank: int, max_loras: int, max_cpu_loras: int | None, dtype_bytes: float
) -> dict[str, int]:
    for name, value in (("lora_rank", rank), ("max_loras", max_loras)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(
                f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}", param=name
            )
    cpu = max_cpu_loras if max_cpu_loras is not None else max_loras
    if cpu < max_loras:
        raise InputError(
            f"--max-cpu-loras must be >= --max-loras ({max_loras}), got {cpu}", param="max_cpu_loras"
        )
    per_element = 4 + (dtype_bytes if dtype_bytes != 4 else 0)  # float32, plus a 16-bit model's copy
    device = int(max_loras * slot_elements(shape, rank) * per_element)
    host = cpu * adapter_elements(shape, rank) * 4
    return {
        "lora_rank": rank,
        "max_loras": max_loras,
        "max_cpu_loras": cpu,
        "lora_slot_bytes": device,
        "lora_cpu_bytes": host,
        "lora_bytes": device + host,
    }
