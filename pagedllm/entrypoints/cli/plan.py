"""`pagedllm plan`: how much KV cache a model needs, how many requests fit, and what paging saves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedllm import planner
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.units import format_size, parse_size

_EPILOG = """\
examples:
  pagedllm plan --model default
      the bundled SmolLM2-135M: KV bytes a token, a block, a full-context request
  pagedllm plan --num-layers 6 --d-model 512 --seq-len 128
      a small model by its shape: 1,572,864 bytes (1.5 MiB) for one 128-token request in fp16
  pagedllm plan --num-layers 40 --d-model 5120 --seq-len 4096 --memory 40GiB
      40 GiB free for KV: 3.125 GiB a request, 12 requests fit, 2.5 GiB left idle
  pagedllm plan --num-layers 40 --d-model 5120 --seq-len 4096 \\
                --memory 80GiB --weights 26GiB --overhead 4GiB
      an 80 GiB card: 50 GiB left for KV after weights and overhead, 16 users
  pagedllm plan --model path/to/hf-folder --weight-dtype int4 --memory 24GiB --seq-len 2048
      weights computed from the model's parameter count at half a byte each
  pagedllm plan --seq-len 100 --max-len 2048 --block-size 16 --plot waste.png
      paged blocks vs reserving max_len slots up front, drawn to a PNG

The KV cache keeps one Key and one Value vector per token and layer:
  kv_bytes = 2 * batch * seq_len * num_layers * kv_width * bytes_per_element
where kv_width = num_kv_heads * head_dim (= d_model without grouped-query attention).
Sizes accept KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (powers of 1000) or plain bytes.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="KV-cache memory planner: bytes a token/request/block, requests that fit, paging waste",
        description=(
            "Work out the KV-cache memory of a model: bytes per token and per request, how many\n"
            "requests fit in a memory budget, and how little paged blocks waste compared with\n"
            "reserving the maximum length up front. Give the model by --model or by its shape."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model shape (from --model, or by hand; flags override the model)")
    m.add_argument(
        "--model",
        metavar="PATH|default",
        help="a Hugging Face folder with config.json, a .gguf file, or 'default' (SmolLM2-135M)",
    )
    m.add_argument("--num-layers", type=int, metavar="L", help="number of decoder layers")
    m.add_argument(
        "--d-model", type=int, metavar="D", help="hidden size; the KV width of plain multi-head attention"
    )
    m.add_argument(
        "--num-kv-heads", type=int, metavar="H", help="key/value heads (fewer than query heads with GQA)"
    )
    m.add_argument(
        "--head-dim", type=int, metavar="D", help="width of one head; kv_width = num_kv_heads * head_dim"
    )
    m.add_argument(
        "--num-params", type=int, metavar="N", help="parameter count, for --weight-dtype without --model"
    )
    r = p.add_argument_group("requests and cache")
    r.add_argument(
        "--dtype", default="fp16", help="KV cache dtype: fp32, fp16, bf16, fp8, int8, int4 (default fp16)"
    )
    r.add_argument(
        "--seq-len", type=int, metavar="S", help="tokens in one request (default: the model's context)"
    )
    r.add_argument(
        "--batch", type=int, default=1, metavar="B", help="requests at once, for the total (default 1)"
    )
    r.add_argument(
        "--max-len",
        type=int,
        metavar="N",
        help="slots a naive cache reserves per request, to compare with paging (default: the model's context)",
    )
    r.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default 16)")
    g = p.add_argument_group("memory budget")
    g.add_argument(
        "--memory", metavar="SIZE", help="memory of the card, e.g. 80GiB (alone: all of it is for KV)"
    )
    g.add_argument("--weights", metavar="SIZE", help="memory the weights take, e.g. 26GiB")
    g.add_argument(
        "--weight-dtype",
        metavar="DTYPE",
        help="compute the weights' size from the parameter count instead, e.g. int4 or fp16",
    )
    g.add_argument("--overhead", metavar="SIZE", help="activations, CUDA context etc., e.g. 4GiB (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object (exact bytes as integers)")
    o.add_argument(
        "--plot", metavar="FILE.png", help="also draw one request's blocks and the memory bar to a PNG"
    )
    p.set_defaults(run=run)
    return p


def load_model_config(model: str) -> tuple[ModelConfig, str]:
    """(config, resolved path) through the loader; imported here so `plan` works without it."""
    if model != "default" and not Path(model).exists():
        raise InputError(
            f"model {model!r} does not exist; give a folder with config.json, a .gguf file, or 'default'",
            param="model",
        )
    try:
        from pagedllm.model.loader import read_model_config, resolve_model_path
    except ImportError as e:
        raise InputError(
            f"--model needs the model loader, which is not available ({e}); "
            "give the shape with --num-layers and --d-model instead",
            param="model",
        ) from None
    try:
        path = resolve_model_path(model)
        return read_model_config(path), str(path)
    except InputError:
        raise
    except (OSError, ValueError, KeyError) as e:  # a damaged or foreign file is bad input, not a crash
        raise InputError(f"cannot read model {model!r}: {e}", param="model") from None


def _opt_size(text: str | None, flag: str) -> int | None:
    return None if text is None else parse_size(text, param=flag)


def build_plan(args: argparse.Namespace) -> dict:
    """Everything the flags determine, as a flat dict of exact integers (plus a few ratios)."""
    plan: dict = {}
    cfg = None
    if args.model:
        cfg, path = load_model_config(args.model)
        plan.update(model=args.model, model_path=path, num_params=planner.param_count(cfg))
        plan.update(max_position_embeddings=cfg.max_position_embeddings)

    num_layers = args.num_layers if args.num_layers is not None else (cfg.num_layers if cfg else None)
    heads, head_dim, width = None, None, None
    if args.num_kv_heads is not None or args.head_dim is not None:
        heads = args.num_kv_heads if args.num_kv_heads is not None else (cfg.num_kv_heads if cfg else None)
        head_dim = args.head_dim if args.head_dim is not None else (cfg.head_dim if cfg else None)
        if heads is None or head_dim is None:
            raise InputError(
                "--num-kv-heads and --head-dim go together (or come from --model)", "num_kv_heads"
            )
        width = planner.kv_width(heads, head_dim)
    elif args.d_model is not None:
        width = args.d_model
    elif cfg:
        heads, head_dim, width = cfg.num_kv_heads, cfg.head_dim, cfg.kv_width
    if (num_layers is None) != (width is None):
        raise InputError(
            "the KV size needs both --num-layers and --d-model (or --num-kv-heads with --head-dim), or --model",
            param="num_layers" if num_layers is None else "d_model",
        )
    dtype = planner.dtype_name(args.dtype)
    plan.update(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim, kv_width=width, dtype=dtype)
    plan["bytes_per_element"] = float(planner.dtype_bytes(dtype))
    if cfg:
        plan.update(d_model=cfg.hidden_size, num_heads=cfg.num_heads)
    elif args.d_model is not None:
        plan["d_model"] = args.d_model

    context = cfg.max_position_embeddings if cfg else None
    seq_len = args.seq_len if args.seq_len is not None else context
    max_len = args.max_len if args.max_len is not None else context
    if args.max_len is None and seq_len is not None and max_len is not None and seq_len > max_len:
        max_len = None  # a default max_len shorter than the request: nothing to compare with
    batch = args.batch
    if batch is None or batch < 1:
        raise InputError(f"--batch must be >= 1, got {batch}", param="batch")
    plan.update(seq_len=seq_len, batch=batch, block_size=args.block_size, max_len=max_len)
    if args.seq_len is None and seq_len is not None:
        plan["seq_len_from_model"] = True  # the model's context length stood in for --seq-len

    per_token = planner.kv_bytes_per_token(num_layers, width, dtype) if num_layers is not None else None
    plan["kv_bytes_per_token"] = per_token
    w = planner.waste(max_len, args.block_size, seq_len) if seq_len is not None else None
    if per_token:
        plan["block_bytes"] = planner.block_bytes(args.block_size, per_token)
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
            kv_bytes_per_request=planner.kv_bytes(1, seq_len, num_layers, width, dtype),
            kv_bytes_total=planner.kv_bytes(batch, seq_len, num_layers, width, dtype),
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

    _plan_memory(args, plan, cfg)
    return {k: v for k, v in plan.items() if v is not None}


def _plan_memory(args: argparse.Namespace, plan: dict, cfg: ModelConfig | None) -> None:
    if args.weights is not None and args.weight_dtype is not None:
        raise InputError("give --weights or --weight-dtype, not both", param="weights")
    weights = _opt_size(args.weights, "weights")
    if args.weight_dtype is not None:
        wdtype = planner.dtype_name(args.weight_dtype)
        params = args.num_params if args.num_params is not None else plan.get("num_params")
        if params is None:
            raise InputError(
                "--weight-dtype needs the parameter count: give --model or --num-params", "weight_dtype"
            )
        weights = planner.weight_bytes(params, wdtype)
        plan.update(weight_dtype=wdtype, num_params=params)
    overhead = _opt_size(args.overhead, "overhead")
    memory = _opt_size(args.memory, "memory")
    plan.update(weight_bytes=weights, overhead_bytes=overhead)
    if memory is None:
        return
    per_request = plan.get("kv_bytes_reserved_per_request")
    if per_request is None:
        raise InputError(
            "--memory needs the KV size of one request: give the model (--model or --num-layers and --d-model) "
            "and --seq-len",
            param="memory",
        )
    cap = planner.capacity(memory, per_request, weights or 0, overhead or 0)
    plan.update(
        memory_bytes=cap.memory_bytes,
        kv_budget_bytes=cap.kv_budget_bytes,
        max_concurrent_requests=cap.max_concurrent,
        leftover_bytes=cap.leftover_bytes,
        batch_fits=plan["batch"] <= cap.max_concurrent,
    )


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
        if "kv_bytes_per_request" in plan:
            what = _n(plan["seq_len"], "token")
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
                f"{_n(plan['seq_len'], 'token')}: {plan['paged_waste_tokens']} slots unused "
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
            naive = f"reserves max_len {plan['max_len']} slots: {plan['naive_waste_tokens']} unused"
            if "waste_ratio" in plan:
                naive += f", {plan['waste_ratio']:.1f}x the paged waste"
            lines.append(row("naive layout", naive))
    if "memory_bytes" in plan:
        lines.append(f"memory {_size(plan['memory_bytes'])}")
        if "weight_bytes" in plan:
            how = (
                f" ({plan['num_params']:,} params in {plan['weight_dtype']})"
                if "weight_dtype" in plan
                else ""
            )
            lines.append(row("weights", _size(plan["weight_bytes"]) + how))
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
    elif "weight_bytes" in plan:
        lines.append(row("weights", _size(plan["weight_bytes"])))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.plot:
        from pagedllm.planner_plot import plot_plan  # matplotlib only when asked for

        plot_plan(plan, args.plot)
        plan["plot"] = args.plot
    if args.json:
        print(json.dumps(plan))
    else:
        print(format_plan(plan))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
