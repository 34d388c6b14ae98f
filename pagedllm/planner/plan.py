"""build_plan: every figure one model shape, request and memory budget determine, as one flat dict.

The inputs are what `pagedllm plan` takes, already parsed: exact integers (sizes may still be text such
as "40GiB", parsed here so that the errors come in the same order as before). Error messages name the
command's flags, since that is where the inputs come from.

Speculative decoding (a draft model, `--speculative-config` method draft_model): the draft keeps its own
paged KV cache with as many blocks of the same block_size as the target's, block i holding both models'
K/V for the same tokens. So every figure made of KV bytes a token (block, request, batch, waste, users
that fit) uses target + draft bytes a token, and the weights in memory are the target's plus the draft's.
Without draft inputs the plan is exactly what it was before they existed.

Tensor parallelism (`--tensor-parallel-size N`, N > 1): the model is split over N devices exactly as
pagedllm/distributed/partition.py says (its head_shards and split are used here, never restated). Every
device holds the same number of KV blocks (one scheduler), each with the K/V of its own KV heads, so the
device with the most KV heads binds: the figures `*_per_device` are that device's, and `--memory`,
`--overhead` and the KV budget are per device. A request's KV is spread over all N devices, so the users
that fit one device are the users that fit in all. The model-wide keys (kv_bytes_per_token, block_bytes,
kv_bytes_per_request, weight_bytes, ...) keep their meaning; `*_in_all` keys add what the N devices hold
together where it differs (memory N x a device's, KV heads replicated on several devices, norms on every
one). With N = 1 (or no N) the plan is exactly what it was before.
"""

from __future__ import annotations

from pagedllm.config import ModelConfig
from pagedllm.distributed.partition import HeadShard, head_shards
from pagedllm.errors import InputError
from pagedllm.planner import lora
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
    draft_config: ModelConfig | None = None,
    draft_model: str | None = None,
    draft_model_path: str | None = None,
    draft_weights: int | str | None = None,
    draft_weight_dtype: str | None = None,
    num_speculative_tokens: int | None = None,
    num_heads: int | None = None,
    tensor_parallel_size: int | None = None,
    lora_rank: int | None = None,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    lora_dtype: str | None = None,
) -> dict:
    """Everything the inputs determine, as a flat dict of exact integers (plus a few ratios).

    `config` (with the `model` name and `model_path` it came from) fills in what the shape flags leave
    out; a flag given explicitly wins over the config. Keys whose value is unknown are left out.

    `draft_config` (with `draft_model`, `draft_model_path`) is a speculative draft model beside the target:
    its KV (in the same cache dtype) and weights (`draft_weights` bytes, or from its parameter count in
    `draft_weight_dtype`) are counted with the target's. `num_speculative_tokens` k adds k KV slots to every
    running request (the positions a speculative step writes past the sequence); it applies with or without
    a draft model (ngram speculation needs the slots too).

    `tensor_parallel_size` N > 1 splits the model over N devices (see the module's docstring) and adds the
    per-device figures; `num_heads` (query heads) is needed for that only without `config` and when the
    KV heads are fewer than N or come from `d_model` alone.

    `lora_rank` R with `max_loras` N (--enable-lora): the adapters' device slots and CPU copies
    (planner/lora.py) count with the weights against the budget; they need `config` for the linears' shapes.
    """
    tp = _tp_size(tensor_parallel_size)
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
    k = _speculative_tokens(num_speculative_tokens)
    plan.update(num_layers=layers, num_kv_heads=heads, head_dim=hdim, kv_width=width, dtype=dtype)
    plan["bytes_per_element"] = float(mem.dtype_bytes(dtype))
    if cfg:
        plan.update(d_model=cfg.hidden_size, num_heads=cfg.num_heads)
    elif d_model is not None:
        plan["d_model"] = d_model
    if num_heads is not None:
        plan["num_heads"] = _whole(num_heads, "num_heads")

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
    draft_per_token = _plan_draft(plan, draft_config, draft_model, draft_model_path, dtype, per_token)
    # Every block holds the target's and the draft's K/V for the same tokens: figures made of bytes a
    # token use both (without a draft this is the target's alone, and every figure is as before).
    total_per_token = None if per_token is None else per_token + (draft_per_token or 0)
    w = mem.waste(max_len, block_size, seq_len) if seq_len is not None else None
    slots = seq_len
    if w and k:
        # A speculative step writes K/V for k positions past the sequence (the draft's proposals, which the
        # target verifies in the same step), so a running request holds seq_len + k slots: its blocks, its
        # bytes and the users that fit count them. A naive cache reserving max_len would need them too.
        slots = seq_len + k
        plan.update(num_speculative_tokens=k, kv_slots_per_request=slots)
        if max_len is not None:
            plan["naive_slots_per_request"] = max_len + k
        w = mem.waste(None if max_len is None else max_len + k, block_size, slots)
    elif k:
        plan["num_speculative_tokens"] = k
    if total_per_token:
        plan["block_bytes"] = mem.block_bytes(block_size, total_per_token)
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
        # kv_bytes(B, S, ...) = B * S * bytes a token; with a draft the bytes a token are both models'.
        plan.update(
            kv_bytes_per_request=slots * total_per_token,
            kv_bytes_total=batch * slots * total_per_token,
            kv_bytes_reserved_per_request=w.blocks_per_request * plan["block_bytes"],
            paged_waste_bytes=w.paged_waste_tokens * total_per_token,
        )
        if max_len is not None:
            plan.update(
                naive_bytes_per_request=(max_len + k) * total_per_token,
                naive_waste_bytes=w.naive_waste_tokens * total_per_token,
            )
    if per_token is None and seq_len is None:
        raise InputError(
            "nothing to plan: give --model, or --num-layers with --d-model (or --num-kv-heads and --head-dim), "
            "and --seq-len; see `pagedllm plan --help`",
            param="model",
        )
    if tp > 1:
        _plan_tp_kv(plan, tp, draft_config, w, slots)
    _plan_lora(plan, cfg, lora_rank, max_loras, max_cpu_loras, lora_dtype or dtype, tp)

    _plan_memory(
        plan,
        memory,
        weights,
        weight_dtype,
        overhead,
        num_params,
        draft_weights,
        draft_weight_dtype,
        tp_config=cfg if num_params is None else None,
    )
    return {key: v for key, v in plan.items() if v is not None}


def _plan_lora(
    plan: dict,
    cfg: ModelConfig | None,
    rank: int | None,
    max_loras: int | None,
    max_cpu_loras: int | None,
    dtype: str,
    tp: int,
) -> None:
    """LoRA adapters' memory (planner/lora.py), added to `plan`; nothing without --lora-rank."""
    if rank is None:
        for value, flag in ((max_loras, "max_loras"), (max_cpu_loras, "max_cpu_loras")):
            if value is not None:
                raise InputError(f"--{flag.replace('_', '-')} needs --lora-rank", param=flag)
        return
    if cfg is None:
        raise InputError("--lora-rank needs --model (the adapters' size is the linears' shapes)", "lora_rank")
    if tp > 1:
        raise InputError(
            "--lora-rank with --tensor-parallel-size is not planned (the engine refuses it)", "lora_rank"
        )
    shape = lora.LoRAShape(
        cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.kv_width, cfg.intermediate_size
    )
    plan.update(
        lora.lora_bytes(shape, rank, max_loras or 1, max_cpu_loras, mem.dtype_bytes(mem.dtype_name(dtype)))
    )


def _whole(value, name: str) -> int:
    """value when it is a whole number >= 1; InputError naming the flag otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}", param=name)
    return value


def _tp_size(value: int | None) -> int:
    """N of --tensor-parallel-size (1 when not given)."""
    return 1 if value is None else _whole(value, "tensor_parallel_size")


def _tp_error(e: InputError) -> InputError:
    """partition.py's error in the command's words (it names the keyword, the command has the flag)."""
    text = str(e).replace("tensor_parallel_size", "--tensor-parallel-size")
    return InputError(text, param="tensor_parallel_size")


def _tp_shards(plan: dict, tp: int) -> list[HeadShard]:
    """Every device's heads, from the plan's shape; with --d-model alone (plain multi-head attention) the
    KV heads are the --num-heads query heads, each d_model / num_heads wide."""
    kv, hdim, q, width = (plan.get(k) for k in ("num_kv_heads", "head_dim", "num_heads", "kv_width"))
    if width is None:
        raise InputError(
            "--tensor-parallel-size splits the model's attention heads: give --model, or --num-layers with "
            "--num-kv-heads and --head-dim",
            param="tensor_parallel_size",
        )
    if kv is None:
        if q is None:
            raise InputError(
                "--tensor-parallel-size splits the attention heads, which --d-model alone does not give: "
                "add --num-heads (or give --num-kv-heads and --head-dim, or --model)",
                param="tensor_parallel_size",
            )
        if width % q:
            raise InputError(f"--d-model {width} is not a multiple of --num-heads {q}", param="num_heads")
        kv, hdim = q, width // q
        plan.update(num_kv_heads=kv, head_dim=hdim)
    if q is None and kv < tp:
        raise InputError(
            f"--tensor-parallel-size {tp} is more than the {kv} KV heads, which are then replicated and their "
            "query heads split among the copies: give --num-heads (or --model)",
            param="num_heads",
        )
    if q is not None and q % kv:
        raise InputError(f"--num-heads {q} is not a multiple of the {kv} KV heads", param="num_heads")
    try:
        # Without the query heads (fewer KV heads than devices is refused above) the KV split is the same
        # for any group size: give one query head a KV head.
        return head_shards(kv if q is None else q, kv, tp)
    except InputError as e:
        raise _tp_error(e) from None


def _plan_tp_kv(
    plan: dict, tp: int, draft: ModelConfig | None, w: mem.Waste | None, slots: int | None
) -> None:
    """The devices' heads and KV bytes: a token, a block and a request on the device that binds (the one with
    the most KV heads), and a token and a request on all of them together (added to `plan`)."""
    if draft is not None:
        raise InputError(
            "--tensor-parallel-size with --draft-model is not planned (how the draft is split is not "
            "settled); plan them apart",
            param="tensor_parallel_size",
        )
    shards = _tp_shards(plan, tp)
    hdim = plan["head_dim"]
    per_device = [
        mem.kv_bytes_per_token(plan["num_layers"], s.num_kv_heads * hdim, plan["dtype"]) for s in shards
    ]
    dev, in_all = max(per_device), sum(per_device)
    plan.update(
        tensor_parallel_size=tp,
        kv_heads_per_device=[s.num_kv_heads for s in shards],
        kv_heads_on_binding_device=max(s.num_kv_heads for s in shards),
        kv_bytes_per_token_per_device=dev,
        kv_bytes_per_token_in_all=in_all,
    )
    if "num_heads" in plan:
        plan["heads_per_device"] = [s.num_heads for s in shards]
    if w is None:
        return
    block = mem.block_bytes(plan["block_size"], dev)
    plan.update(
        block_bytes_per_device=block,
        kv_bytes_per_request_per_device=slots * dev,
        kv_bytes_total_per_device=plan["batch"] * slots * dev,
        kv_bytes_reserved_per_request_per_device=w.blocks_per_request * block,
        kv_bytes_reserved_per_request_in_all=w.paged_slots * in_all,
        paged_waste_bytes_per_device=w.paged_waste_tokens * dev,
    )


def _tp_weights(
    plan: dict, weight_bytes: int, wdtype: str | None, cfg: ModelConfig | None
) -> tuple[int, int]:
    """(weights on the largest device, weights on all devices together) under tensor parallelism.

    With the model's shape (`cfg`): its parameters per device (memory.param_count_per_rank) in --weight-dtype,
    or a --weights total scaled by each device's share of the parameters. Without it (only --num-params or
    --weights): weights / N a device, which the plan says it assumed."""
    tp = plan["tensor_parallel_size"]
    if cfg is None:
        plan["weights_per_device_assumed"] = f"weights / {tp}, without the model's full shape"
        return -(-weight_bytes // tp), weight_bytes
    params = mem.param_count_per_rank(cfg, tp)
    plan["num_params_per_device"] = max(params)
    if wdtype is not None:
        per_device = [mem.weight_bytes(p, wdtype) for p in params]
        return max(per_device), sum(per_device)
    plan["weights_per_device_assumed"] = "the --weights total times the device's share of the parameters"
    total = plan["num_params"]
    return -(-weight_bytes * max(params) // total), -(-weight_bytes * sum(params) // total)


def _speculative_tokens(value: int | None) -> int:
    """k of --num-speculative-tokens (0 when not given); InputError naming the flag when not >= 1."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(
            f"--num-speculative-tokens must be a whole number >= 1, got {value!r}",
            param="num_speculative_tokens",
        )
    return value


def _plan_draft(
    plan: dict,
    cfg: ModelConfig | None,
    name: str | None,
    path: str | None,
    dtype: str,
    target_per_token: int | None,
) -> int | None:
    """The draft model's shape and KV bytes a token (in the target's cache dtype), added to `plan`."""
    if cfg is None:
        return None
    if target_per_token is None:
        raise InputError(
            "--draft-model shares the target's KV blocks: give the target too "
            "(--model, or --num-layers with --d-model)",
            param="draft_model",
        )
    per_token = mem.kv_bytes_per_token(cfg.num_layers, cfg.kv_width, dtype)
    plan.update(
        draft_model=name,
        draft_model_path=path,
        draft_num_params=mem.param_count(cfg),
        draft_num_layers=cfg.num_layers,
        draft_num_kv_heads=cfg.num_kv_heads,
        draft_head_dim=cfg.head_dim,
        draft_kv_width=cfg.kv_width,
        draft_kv_bytes_per_token=per_token,
        total_kv_bytes_per_token=target_per_token + per_token,
    )
    return per_token


def _draft_weight_bytes(
    plan: dict,
    draft_weights: int | str | None,
    draft_weight_dtype: str | None,
    target_weight_dtype: str | None,
    target_weight_bytes: int | None,
) -> int | None:
    """The draft's weights: given (--draft-weights), from its parameter count (--draft-weight-dtype, or
    the target's --weight-dtype when that alone is given), or None when no weights are counted at all."""
    has_draft = "draft_num_params" in plan
    for value, flag in ((draft_weights, "draft_weights"), (draft_weight_dtype, "draft_weight_dtype")):
        if value is not None and not has_draft:
            raise InputError(f"--{flag.replace('_', '-')} needs --draft-model", param=flag)
    if not has_draft:
        return None
    if draft_weights is not None and draft_weight_dtype is not None:
        raise InputError("give --draft-weights or --draft-weight-dtype, not both", param="draft_weights")
    if draft_weights is not None:
        return _opt_size(draft_weights, "draft_weights")
    wdtype = draft_weight_dtype if draft_weight_dtype is not None else target_weight_dtype
    if wdtype is not None:
        try:
            wdtype = mem.dtype_name(wdtype)
        except InputError as e:
            raise InputError(f"--draft-weight-dtype: {e}", param="draft_weight_dtype") from None
        plan["draft_weight_dtype"] = wdtype
        return mem.weight_bytes(plan["draft_num_params"], wdtype)
    if target_weight_bytes is not None:  # counting the target's weights and not the draft's would mislead
        raise InputError(
            "--weights is the target's alone: give the draft's too, with --draft-weights SIZE "
            "or --draft-weight-dtype DTYPE",
            param="draft_weights",
        )
    return None


def _plan_memory(
    plan: dict,
    memory: int | str | None,
    weights: int | str | None,
    weight_dtype: str | None,
    overhead: int | str | None,
    num_params: int | None,
    draft_weights: int | str | None = None,
    draft_weight_dtype: str | None = None,
    tp_config: ModelConfig | None = None,
) -> None:
    """Weights (the target's, plus a draft's), overhead and, with a memory budget, how many requests fit
    (added to `plan`). Under tensor parallelism the budget is a device's; `tp_config` is the model whose
    shape the weights per device come from (None: weights / N)."""
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
    draft_bytes = _draft_weight_bytes(plan, draft_weights, draft_weight_dtype, weight_dtype, weight_bytes)
    overhead_bytes = _opt_size(overhead, "overhead")
    memory_bytes = _opt_size(memory, "memory")
    plan.update(weight_bytes=weight_bytes, overhead_bytes=overhead_bytes)
    all_weights = weight_bytes
    if draft_bytes is not None:
        all_weights = (weight_bytes or 0) + draft_bytes
        plan.update(draft_weight_bytes=draft_bytes, total_weight_bytes=all_weights)
    if "lora_bytes" in plan:  # the adapters sit beside the weights (--enable-lora)
        all_weights = (all_weights or 0) + plan["lora_bytes"]
    tp = plan.get("tensor_parallel_size", 1)
    weights_in_all = all_weights
    if tp > 1 and weight_bytes is not None:
        all_weights, weights_in_all = _tp_weights(plan, weight_bytes, plan.get("weight_dtype"), tp_config)
        plan.update(weight_bytes_per_device=all_weights, weight_bytes_in_all=weights_in_all)
    if memory_bytes is None:
        return
    if tp > 1:
        _plan_tp_capacity(plan, memory_bytes, all_weights or 0, weights_in_all or 0, overhead_bytes or 0)
        return
    per_request = _request_kv_bytes(plan, "kv_bytes_reserved_per_request")
    cap = mem.capacity(memory_bytes, per_request, all_weights or 0, overhead_bytes or 0)
    plan.update(
        memory_bytes=cap.memory_bytes,
        kv_budget_bytes=cap.kv_budget_bytes,
        max_concurrent_requests=cap.max_concurrent,
        leftover_bytes=cap.leftover_bytes,
        batch_fits=plan["batch"] <= cap.max_concurrent,
    )
    if "draft_kv_bytes_per_token" in plan:  # the pool the engine makes: each block holds both models' K/V
        per_model = [plan["kv_bytes_per_token"], plan["draft_kv_bytes_per_token"]]
        plan["num_blocks"] = mem.num_blocks_for(cap.kv_budget_bytes, plan["block_size"], per_model)


def _request_kv_bytes(plan: dict, key: str) -> int:
    """One request's KV bytes (`key`), which --memory needs to count users."""
    if key not in plan:
        raise InputError(
            "--memory needs the KV size of one request: give the model (--model or --num-layers and --d-model) "
            "and --seq-len",
            param="memory",
        )
    return plan[key]


def _plan_tp_capacity(plan: dict, memory: int, weights: int, weights_in_all: int, overhead: int) -> None:
    """Users that fit N devices of `memory` each (weights a device, overhead a device): the device that binds
    has the most KV heads and the largest share of the weights (partition.py gives the first ranks the
    extra heads, rows and columns), and every device keeps as many blocks as it does."""
    per_request = _request_kv_bytes(plan, "kv_bytes_reserved_per_request_per_device")
    tp = plan["tensor_parallel_size"]
    try:
        cap = mem.capacity(memory, per_request, weights, overhead)
    except InputError as e:  # the weights do not fit: say that the figures are a device's
        raise InputError(f"{e} (on each of the {tp} devices)", param=e.param) from None
    budget_in_all = tp * (memory - overhead) - weights_in_all
    plan.update(
        memory_bytes=cap.memory_bytes,
        kv_budget_bytes=cap.kv_budget_bytes,
        max_concurrent_requests=cap.max_concurrent,
        leftover_bytes=cap.leftover_bytes,
        batch_fits=plan["batch"] <= cap.max_concurrent,
        num_blocks_per_device=mem.num_blocks_for(
            cap.kv_budget_bytes, plan["block_size"], [plan["kv_bytes_per_token_per_device"]]
        ),
        memory_bytes_in_all=tp * memory,
        kv_budget_bytes_in_all=budget_in_all,
        leftover_bytes_in_all=budget_in_all
        - cap.max_concurrent * plan["kv_bytes_reserved_per_request_in_all"],
    )
