"""format_plan: a build_plan dict as the text `pagedllm plan` prints (exact bytes and their units)."""

from __future__ import annotations

from pagedllm.units import format_size


def _size(n: int) -> str:
    """Exact bytes and the binary unit; the decimal unit too once it reaches a GB."""
    text = f"{n:,} bytes ({format_size(n)}"
    if n >= 1000**3:
        text += f" = {format_size(n, binary=False)}"
    return text + ")"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def format_plan(plan: dict) -> str:
    lines: list[str] = []
    row = "  {:<26}{}".format
    if "model" in plan:
        lines.append(f"model {plan['model']} ({plan['model_path']}): {plan['num_params']:,} parameters")
    if "draft_num_params" in plan:
        lines.append(
            f"draft model {plan['draft_model']} ({plan['draft_model_path']}): {plan['draft_num_params']:,} "
            "parameters, its own KV in the same blocks"
        )
    if "kv_bytes_per_token" in plan:
        shape = f"{plan['num_layers']} layers, kv_width {plan['kv_width']}"
        if "num_kv_heads" in plan:
            shape += f" = {plan['num_kv_heads']} KV heads x {plan['head_dim']}"
        lines.append(f"KV cache in {plan['dtype']} ({plan['bytes_per_element']:g} bytes an element), {shape}")
        lines.append(
            row(
                "per token",
                f"{_size(plan['kv_bytes_per_token'])} = 2 (K and V) x {plan['num_layers']} layers "
                f"x {plan['kv_width']} x {plan['bytes_per_element']:g} bytes",
            )
        )
        if "draft_kv_bytes_per_token" in plan:
            lines.append(
                row(
                    "draft per token",
                    f"{_size(plan['draft_kv_bytes_per_token'])} = 2 x {plan['draft_num_layers']} layers "
                    f"x {plan['draft_kv_width']} x {plan['bytes_per_element']:g} bytes",
                )
            )
            lines.append(
                row(
                    "target + draft",
                    f"{_size(plan['total_kv_bytes_per_token'])} a token: every block holds both models' K/V",
                )
            )
        if "num_speculative_tokens" in plan:
            k = plan["num_speculative_tokens"]
            per = plan.get("total_kv_bytes_per_token", plan["kv_bytes_per_token"])
            adds = f"+{_n(k, 'KV slot')} ({k * per:,} bytes) a running request, the positions a step writes"
            lines.append(row("speculation", f"{_n(k, 'token')} proposed a step: {adds}"))
        if "kv_bytes_per_request" in plan:
            what = _n(plan["seq_len"], "token")
            if "kv_slots_per_request" in plan:
                what += f" + {plan['num_speculative_tokens']} speculative slots"
            if plan.get("seq_len_from_model"):
                what += " (the model's full context; set --seq-len for your requests)"
            lines.append(row("per request", f"{_size(plan['kv_bytes_per_request'])} for {what}"))
            if plan["batch"] > 1:
                lines.append(row(f"batch of {plan['batch']}", _size(plan["kv_bytes_total"])))
    if "blocks_per_request" in plan:
        lines.append(f"paged blocks of {plan['block_size']} tokens")
        if "block_bytes" in plan:
            lines.append(row("one block", _size(plan["block_bytes"])))
        lines.append(
            row(
                "one request",
                f"{_n(plan['blocks_per_request'], 'block')} = {plan['paged_slots_per_request']} slots for "
                f"{_n(plan['seq_len'], 'token')}{_spec_slots(plan)}: {plan['paged_waste_tokens']} slots unused "
                f"({plan['last_block_waste_fraction']:.2%} of the last block)",
            )
        )
        if "kv_bytes_reserved_per_request" in plan:
            lines.append(
                row(
                    "",
                    f"holds {_size(plan['kv_bytes_reserved_per_request'])}, "
                    f"{plan['paged_waste_bytes']:,} bytes of it unused",
                )
            )
        if "naive_waste_tokens" in plan:
            naive = f"reserves max_len {plan['max_len']}{_spec_slots(plan)} slots: {plan['naive_waste_tokens']} unused"
            if "waste_ratio" in plan:
                naive += f", {plan['waste_ratio']:.1f}x the paged waste"
            lines.append(row("naive layout", naive))
    if "tensor_parallel_size" in plan:
        return "\n".join(lines + _tp_lines(plan, row))
    if "memory_bytes" in plan:
        lines.append(f"memory {_size(plan['memory_bytes'])}")
        if "weight_bytes" in plan:
            how = (
                f" ({plan['num_params']:,} params in {plan['weight_dtype']})"
                if "weight_dtype" in plan
                else ""
            )
            lines.append(row("weights", _size(plan["weight_bytes"]) + how))
        lines += _draft_weights(plan, row)
        lines += _lora(plan, row)
        if "overhead_bytes" in plan:
            lines.append(row("overhead", _size(plan["overhead_bytes"])))
        lines.append(row("KV budget", _size(plan["kv_budget_bytes"])))
        lines.append(
            row(
                "max concurrent requests",
                f"{plan['max_concurrent_requests']} at {_size(plan['kv_bytes_reserved_per_request'])} each",
            )
        )
        lines.append(row("left idle", _size(plan["leftover_bytes"])))
        if "num_blocks" in plan:
            lines.append(
                row(
                    "KV blocks",
                    f"{plan['num_blocks']:,} of {plan['block_bytes']:,} bytes, target and draft K/V in each",
                )
            )
    else:
        if "weight_bytes" in plan:
            lines.append(row("weights", _size(plan["weight_bytes"])))
        lines += _draft_weights(plan, row)
        lines += _lora(plan, row)
    return "\n".join(lines)


def _spec_slots(plan: dict) -> str:
    """ " + k" after a token count when a speculative step adds k slots to every running request."""
    return f" + {plan['num_speculative_tokens']}" if "kv_slots_per_request" in plan else ""


def _lora(plan: dict, row) -> list[str]:
    """LoRA adapters (--lora-rank): the device slots and the loaded copies, counted with the weights."""
    if "lora_bytes" not in plan:
        return []
    return [
        row(
            "LoRA adapters",
            f"{_size(plan['lora_bytes'])} ({plan['max_loras']} slots of rank {plan['lora_rank']}: "
            f"{_size(plan['lora_slot_bytes'])}; {plan['max_cpu_loras']} loaded, float32: "
            f"{_size(plan['lora_cpu_bytes'])})",
        )
    ]


def _draft_weights(plan: dict, row) -> list[str]:
    """The draft model's weights and the target + draft total (the weights the budget pays for)."""
    if "draft_weight_bytes" not in plan:
        return []
    how = (
        f" ({plan['draft_num_params']:,} params in {plan['draft_weight_dtype']})"
        if "draft_weight_dtype" in plan
        else ""
    )
    return [
        row("draft weights", _size(plan["draft_weight_bytes"]) + how),
        row("weights in all", _size(plan["total_weight_bytes"])),
    ]


def _per_device(counts: list[int]) -> str:
    """[2, 1] -> "2, 1"; [1, 1, 1, 1] -> "1 each"; many uneven devices -> "2 on 3 devices, 1 on 5"."""
    if len(set(counts)) == 1:
        return f"{counts[0]} each"
    if len(counts) <= 8:
        return ", ".join(map(str, counts))
    runs = [(v, counts.count(v)) for v in sorted(set(counts), reverse=True)]
    return ", ".join(f"{v} on {_n(k, 'device')}" for v, k in runs)


def _tp_lines(plan: dict, row) -> list[str]:
    """Tensor parallelism: the KV figures of the device that binds, then the memory a device and in all."""
    n, p = plan["tensor_parallel_size"], plan["bytes_per_element"]
    heads = plan["kv_heads_on_binding_device"]
    lines = [
        f"tensor parallel over {n} devices: heads by KV-head groups, MLP and vocabulary split, norms on every "
        "device"
    ]
    split = f"KV {_per_device(plan['kv_heads_per_device'])}"
    if len(set(plan["kv_heads_per_device"])) > 1:
        split += f" (every device keeps as many blocks as the one with {heads} KV heads)"
    if "heads_per_device" in plan:
        split = f"query {_per_device(plan['heads_per_device'])}; " + split
    lines.append(row("heads per device", split))
    per_token = (
        f"{_size(plan['kv_bytes_per_token_per_device'])} = 2 x {plan['num_layers']} layers "
        f"x {_n(heads, 'KV head')} x {plan['head_dim']} x {p:g} bytes"
    )
    if plan["kv_bytes_per_token_in_all"] != plan["kv_bytes_per_token"]:  # KV heads replicated
        per_token += f"; {plan['kv_bytes_per_token_in_all']:,} bytes in all"
    lines.append(row("per token per device", per_token))
    if "block_bytes_per_device" in plan:
        lines.append(row("one block per device", _size(plan["block_bytes_per_device"])))
        lines.append(
            row(
                "a request per device",
                f"holds {_size(plan['kv_bytes_reserved_per_request_per_device'])}, "
                f"{plan['paged_waste_bytes_per_device']:,} bytes of it unused",
            )
        )
        if plan["batch"] > 1:
            lines.append(
                row(f"batch of {plan['batch']} per device", _size(plan["kv_bytes_total_per_device"]))
            )
    if "memory_bytes" in plan:
        lines.append(
            f"memory {_size(plan['memory_bytes'])} a device, {_size(plan['memory_bytes_in_all'])} in all"
        )
    elif "weight_bytes_per_device" in plan:
        lines.append(f"weights over {n} devices")
    if "weight_bytes_per_device" in plan:
        how = f" ({plan['num_params']:,} params in {plan['weight_dtype']})" if "weight_dtype" in plan else ""
        lines.append(row("weights of the model", _size(plan["weight_bytes"]) + how))
        if "weights_per_device_assumed" in plan:
            how = f" (assumed: {plan['weights_per_device_assumed']})"
        else:
            how = f" ({plan['num_params_per_device']:,} params, the largest device's share)"
        lines.append(row("weights per device", _size(plan["weight_bytes_per_device"]) + how))
        if plan["weight_bytes_in_all"] != plan["weight_bytes"]:
            lines.append(
                row(
                    "weights in all",
                    f"{_size(plan['weight_bytes_in_all'])}: norms (and shared KV heads) on each device",
                )
            )
    if "memory_bytes" not in plan:
        return lines
    if "overhead_bytes" in plan:
        lines.append(row("overhead per device", _size(plan["overhead_bytes"])))
    lines.append(row("KV budget per device", _size(plan["kv_budget_bytes"])))
    users = plan["max_concurrent_requests"]
    lines.append(
        row(
            "max concurrent requests",
            f"{users} at {_size(plan['kv_bytes_reserved_per_request_per_device'])} each a device; "
            f"{users} in all too: each request's KV is spread over the {n} devices",
        )
    )
    lines.append(
        row(
            "KV blocks per device",
            f"{plan['num_blocks_per_device']:,} of {plan['block_bytes_per_device']:,} bytes",
        )
    )
    lines.append(
        row(
            "left idle per device",
            f"{_size(plan['leftover_bytes'])}; {_size(plan['leftover_bytes_in_all'])} in all",
        )
    )
    return lines
