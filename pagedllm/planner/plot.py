"""Draw a `pagedllm plan` result: one request's slots (naive vs paged) and the memory bar."""

from __future__ import annotations

from pagedllm import plot_style as style
from pagedllm.errors import InputError
from pagedllm.units import format_size

USED, WASTED, WEIGHTS, OVERHEAD, IDLE = style.USED, style.WASTED, style.PEER, style.OVERHEAD, style.IDLE
KV_SHADES = (style.OURS, style.OURS_LIGHT)
MAX_BOUNDARIES = 64  # more block lines than this is a smear; skip them
MAX_USER_SEGMENTS = 128
QUANTIZED = ("int8", "int4", "fp8")  # weight dtypes that are a quantization


def _meta(plan: dict) -> dict:
    """The header's fields. No CPU: a plan is arithmetic for any machine, not a measurement of this one."""
    shape = f"{plan['num_layers']} layers, kv_width {plan['kv_width']}" if "kv_width" in plan else None
    wdtype = plan.get("weight_dtype")
    return {
        "model": plan.get("model") or shape,
        "dtype": f"{plan['dtype']} (KV cache)" if "dtype" in plan else None,
        "quantization": (wdtype if wdtype in QUANTIZED else "none") if wdtype else None,
        "cpu": False,
    }


def plan_figure(plan: dict):
    """The Figure, with up to two panels; which ones depends on the keys the plan holds."""
    panels = [
        name for name, key in (("slots", "blocks_per_request"), ("memory", "memory_bytes")) if key in plan
    ]
    if not panels:
        raise InputError("--plot needs --seq-len (one request's blocks) or --memory (the memory bar)", "plot")
    with style.styled() as plt:
        fig, axes = style.figure(plt, len(panels), 1, figsize=(10, 1.0 + 2.6 * len(panels)), squeeze=False)
        for ax, name in zip(axes[:, 0], panels):
            (_draw_slots if name == "slots" else _draw_memory)(ax, plan)
        fig.suptitle(style.header("pagedllm plan: KV-cache memory", **_meta(plan)))
    return fig


def plot_plan(plan: dict, path: str) -> None:
    """Write plan_figure to a PNG (an unwritable path is an InputError)."""
    style.save(plan_figure(plan), path, make_dirs=False, dpi=110)


def _draw_slots(ax, plan: dict) -> None:
    s, bs = plan["seq_len"], plan["block_size"]
    slots, blocks = plan["paged_slots_per_request"], plan["blocks_per_request"]
    rows = ["paged"]
    ax.barh(0, s, color=USED, label=f"used: {s} tokens")
    ax.barh(0, slots - s, left=s, color=WASTED, hatch="//", label="reserved, unused")
    if blocks <= MAX_BOUNDARIES:
        for b in range(blocks + 1):
            ax.plot([b * bs, b * bs], [-0.4, 0.4], color="black", linewidth=0.8)
    ax.text(slots, 0, f"  {blocks} blocks, {slots - s} unused", va="center", fontsize=8)
    if "max_len" in plan:
        m = plan["max_len"]
        rows.append("naive")
        ax.barh(1, s, color=USED)
        ax.barh(1, m - s, left=s, color=WASTED, hatch="//")
        ax.text(m, 1, f"  max_len {m}, {m - s} unused", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("token slots of one request")
    style.integer_ticks(ax.xaxis)
    ax.set_title(f"one request of {s} tokens in blocks of {bs}")
    ax.margins(x=0.25)
    ax.legend(loc="lower right", fontsize=8)


def _draw_memory(ax, plan: dict) -> None:
    gib = 1024**3
    left = 0.0

    def seg(size: int, color: str, label: str | None = None, hatch: str | None = None) -> None:
        nonlocal left
        ax.barh(
            0, size / gib, left=left, color=color, edgecolor="white", linewidth=0.3, label=label, hatch=hatch
        )
        left += size / gib

    # Under tensor parallelism the bar is one device (the one that binds): its weights, blocks and budget.
    tp = plan.get("tensor_parallel_size", 1)
    weights = plan.get("weight_bytes_per_device", plan.get("weight_bytes"))
    if weights:
        seg(weights, WEIGHTS, f"weights {format_size(weights)}")
    if plan.get("draft_weight_bytes"):  # a speculative draft model's weights, beside the target's
        draft = plan["draft_weight_bytes"]
        seg(draft, WEIGHTS, f"draft weights {format_size(draft)}", hatch="xx")
    if plan.get("overhead_bytes"):
        seg(plan["overhead_bytes"], OVERHEAD, f"overhead {format_size(plan['overhead_bytes'])}")
    users = plan["max_concurrent_requests"]
    per = plan.get("kv_bytes_reserved_per_request_per_device", plan["kv_bytes_reserved_per_request"])
    label = f"KV: {users} requests x {format_size(per)}"
    if users <= MAX_USER_SEGMENTS:
        for i in range(users):
            seg(per, KV_SHADES[i % 2], label if i == 0 else None)
    elif users:
        seg(users * per, KV_SHADES[0], label)
    seg(plan["leftover_bytes"], IDLE, f"idle {format_size(plan['leftover_bytes'])}", hatch="..")
    ax.set_yticks([])
    ax.set_xlim(0, plan["memory_bytes"] / gib)
    ax.set_xlabel("GiB")
    ax.set_title(
        f"memory {format_size(plan['memory_bytes'])}: KV budget {format_size(plan['kv_budget_bytes'])}"
        + (f" (a device of {tp}, tensor parallel)" if tp > 1 else "")
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)  # beside the bar
