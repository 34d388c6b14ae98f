"""build_plan: every figure one model shape, request and memory budget determine, as one flat dict.

The inputs are what `pagedllm plan` takes, already parsed: exact integers (sizes may still be text such
as "40GiB", parsed here so that the errors come in the same order as before). Error messages name the
command's flags, since that is where the inputs come from.
"""

from __future__ import annotations

from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.planner import memory as mem
from pagedllm.units import parse_size


def _opt_size(value: int | str | None, flag: str) -> int | None:
    if value is None or isinstance(value, int):
        return value
    return parse_size(value, param=flag)


def build_plan(
    *,
    config: ModelConfig | None = None,
    model: str | None = None,
    model_path: str | None = None,
    num_layers: int | None = None,
    d_model: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    num_params: int | None = None,
    dtype: str = "fp16",
    seq_len: int | None = None,
    batch: int = 1,
    max_len: int | None = None,
    block_size: int = 16,
    memory: int | str | None = None,
    weights: int | str | None = None,
    weight_dtype: str | None = None,
    overhead: int | str | None = None,
) -> dict:
    """Everything the inputs determine, as a flat dict of exact integers (plus a few ratios).

    `config` (with the `model` name and `model_path` it came from) fills in what the shape flags leave
    out; a flag given explicitly wins over the config. Keys whose value is unknown are left out.
    """
    plan: dict = {}
    cfg = config
    if cfg:
        plan.update(model=model, model_path=model_path, num_params=mem.param_count(cfg))
        plan.update(max_position_embeddings=cfg.max_position_embeddings)

    layers = num_layers if num_layers is not None else (cfg.num_layers if cfg else None)
    heads, hdim, width = None, None, None
    if num_kv_heads is not None or head_dim is not None:
        heads = num_kv_heads if num_kv_heads is not None else (cfg.num_kv_heads if cfg else None)
        hdim = head_dim if head_dim is not None else (cfg.head_dim if cfg else None)
        if heads is None or hdim is None:
            raise InputError(
                "--num-kv-heads and --head-dim go together (or come from --model)", "num_kv_heads"
            )
        width = mem.kv_width(heads, hdim)
    elif d_model is not None:
        width = d_model
    elif cfg:
        heads, hdim, width = cfg.num_kv_heads, cfg.head_dim, cfg.kv_width
    if (layers is None) != (width is None):
        raise InputError(
            "the KV size needs both --num-layers and --d-model (or --num-kv-heads with --head-dim), or --model",
            param="num_layers" if layers is None else "d_model",
        )
    dtype = mem.dtype_name(dtype)
    plan.update(num_layers=layers, num_kv_heads=heads, head_dim=hdim, kv_width=width, dtype=dtype)
    plan["bytes_per_element"] = float(mem.dtype_bytes(dtype))
    if cfg:
        plan.update(d_model=cfg.hidden_size, num_heads=cfg.num_heads)
    elif d_model is not None:
        plan["d_model"] = d_model

    context = cfg.max_position_embeddings if cfg else None
    seq_len_given, max_len_given = seq_len, max_len
    seq_len = seq_len if seq_len is not None else context
    max_len = max_len if max_len is not None else context
    if max_len_given is None and seq_len is not None and max_len is not None and seq_len > max_len:
        max_len = None  # a default max_len shorter than the request: nothing to compare with
    if batch is None or batch < 1:
        raise InputError(f"--batch must be >= 1, got {batch}", param="batch")
    plan.update(seq_len=seq_len, batch=batch, block_size=block_size, max_len=max_len)
    if seq_len_given is None and seq_len is not None:
        plan["seq_len_from_model"] = True  # the model's context length stood in for --seq-len

    per_token = mem.kv_bytes_per_token(layers, width, dtype) if layers is not None else None
    plan["kv_bytes_per_token"] = per_token
    w = mem.waste(max_len, block_size, seq_len) if seq_len is not None else None
    if per_token:
        plan["block_bytes"] = mem.block_bytes(block_size, per_token)
    if w:
        plan.update(
            blocks_per_request=w.blocks_per_request,
            paged_slots_per_request=w.paged_slots,
            paged_waste_tokens=w.paged_waste_tokens,
            last_block_waste_fraction=float(w.last_block_waste),
            naive_waste_tokens=w.naive_waste_tokens,
            waste_ratio=None if w.ratio is None else float(w.ratio),
        )
    if per_token and w:
        plan.update(
            kv_bytes_per_request=mem.kv_bytes(1, seq_len, layers, width, dtype),
            kv_bytes_total=mem.kv_bytes(batch, seq_len, layers, width, dtype),
            kv_bytes_reserved_per_request=w.blocks_per_request * plan["block_bytes"],
            paged_waste_bytes=w.paged_waste_tokens * per_token,
        )
        if max_len is not None:
            plan.update(
                naive_bytes_per_request=max_len * per_token,
                naive_waste_bytes=w.naive_waste_tokens * per_token,
            )
    if per_token is None and seq_len is None:
        raise InputError(
            "nothing to plan: give --model, or --num-layers with --d-model (or --num-kv-heads and --head-dim), "
            "and --seq-len; see `pagedllm plan --help`",
            param="model",
        )

    _plan_memory(plan, memory, weights, weight_dtype, overhead, num_params)
    return {k: v for k, v in plan.items() if v is not None}


def _plan_memory(
    plan: dict,
    memory: int | str | None,
    weights: int | str | None,
    weight_dtype: str | None,
    overhead: int | str | None,
    num_params: int | None,
) -> None:
    """Weights, overhead and, with a memory budget, how many requests fit (added to `plan`)."""
    if weights is not None and weight_dtype is not None:
        raise InputError("give --weights or --weight-dtype, not both", param="weights")
    weight_bytes = _opt_size(weights, "weights")
    if weight_dtype is not None:
        wdtype = mem.dtype_name(weight_dtype)
        params = num_params if num_params is not None else plan.get("num_params")
        if params is None:
            raise InputError(
                "--weight-dtype needs the parameter count: give --model or --num-params", "weight_dtype"
            )
        weight_bytes = mem.weight_bytes(params, wdtype)
        plan.update(weight_dtype=wdtype, num_params=params)
    overhead_bytes = _opt_size(overhead, "overhead")
    memory_bytes = _opt_size(memory, "memory")
    plan.update(weight_bytes=weight_bytes, overhead_bytes=overhead_bytes)
    if memory_bytes is None:
        return
    per_request = plan.get("kv_bytes_reserved_per_request")
    if per_request is None:
        raise InputError(
            "--memory needs the KV size of one request: give the model (--model or --num-layers and --d-model) "
            "and --seq-len",
            param="memory",
        )
    cap = mem.capacity(memory_bytes, per_request, weight_bytes or 0, overhead_bytes or 0)
    plan.update(
        memory_bytes=cap.memory_bytes,
        kv_budget_bytes=cap.kv_budget_bytes,
        max_concurrent_requests=cap.max_concurrent,
        leftover_bytes=cap.leftover_bytes,
        batch_fits=plan["batch"] <= cap.max_concurrent,
    )
