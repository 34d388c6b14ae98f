"""How tensor parallelism splits a model over N ranks: plain arithmetic, shared by the engine and the planner.

Attention heads go by KV-head groups: rank r gets a contiguous run of KV heads and every query head that
reads them, so each rank attends its heads with no communication. The runs are as even as the count
allows (3 KV heads over 2 ranks: 2 and 1), which vLLM refuses and a 3-KV-head model needs. With fewer KV
heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks (which must divide evenly,
as in vLLM) and its query heads are split among them. Other dimensions (the MLP's intermediate size, the
vocabulary) split into contiguous parts whose boundaries fall on a multiple of `multiple` (a quantized
weight's group along the input), the last part taking what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InputError


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads [q_start, q_end) and KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def split(n: int, parts: int, multiple: int = 1) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` contiguous ranges covering 0..n, as even as units of `multiple`
    allow (earlier ranges take the extra units); the last range ends at n even when n is not a multiple."""
    units = -(-n // multiple)
    if units < parts:
        raise InputError(
            f"tensor_parallel_size {parts} exceeds the {units} parts of {multiple} that a dimension of "
            f"{n} splits into",
            param="tensor_parallel_size",
        )
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = min(n, start + (base + (r < extra)) * multiple)
        bounds.append((start, end))
        start = end
    return bounds


def head_shards(num_heads: int, num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Every rank's heads (see the module's docstring)."""
    if tp_size < 1:
        raise InputError(
            f"tensor_parallel_size must be at least 1, got {tp_size}", param="tensor_parallel_size"
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        return [HeadShard(a * group, b * group, a, b) for a, b in split(num_kv_heads, tp_size)]
    if tp_size % num_kv_heads:
        raise InputError(
            f"tensor_parallel_size {tp_size} must divide evenly among the model's {num_kv_heads} KV heads "
            "(each KV head is replicated on tensor_parallel_size / num_kv_heads ranks)",
            param="tensor_parallel_size",
        )
    per_kv = tp_size // num_kv_heads
    if group < per_kv:
        raise InputError(
            f"tensor_parallel_size {tp_size} exceeds the model's {num_heads} attention heads",
            param="tensor_parallel_size",
        )
    shards = []
    for kv in range(num_kv_heads):
        for a, b in split(group, per_kv):
            shards.append(HeadShard(kv * group + a, kv * group + b, kv, kv + 1))
    return shards
