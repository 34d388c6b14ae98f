"""The KV-cache planner: plain functions on exact integers, no torch, no argparse, no model loader.

    memory.py   the arithmetic: bytes a token, a request and a block take, weights, capacity, paging waste
    plan.py     build_plan: every figure one set of inputs determines, as a flat dict
    report.py   format_plan: that dict as the text `pagedllm plan` prints
    plot.py     plot_plan: the same dict drawn to a PNG (matplotlib, imported only when called)

`pagedllm plan` (entrypoints/cli/plan.py) only parses flags, loads the model's config and prints; the
engine sizes its cache with memory.py at start-up.
"""

from pagedllm.planner.memory import (
    DTYPE_BYTES,
    Capacity,
    Waste,
    block_bytes,
    capacity,
    dtype_bytes,
    dtype_name,
    kv_bytes,
    kv_bytes_per_token,
    kv_width,
    num_blocks_for,
    param_count,
    param_count_per_rank,
    waste,
    weight_bytes,
)
from pagedllm.planner.plan import build_plan
from pagedllm.planner.report import format_plan

__all__ = [
    "DTYPE_BYTES",
    "Capacity",
    "Waste",
    "block_bytes",
    "build_plan",
    "capacity",
    "dtype_bytes",
    "dtype_name",
    "format_plan",
    "kv_bytes",
    "kv_bytes_per_token",
    "kv_width",
    "num_blocks_for",
    "param_count",
    "param_count_per_rank",
    "waste",
    "weight_bytes",
]
