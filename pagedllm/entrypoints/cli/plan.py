"""`pagedllm plan`: how much KV cache a model needs, how many requests fit, and what paging saves.

Argument parsing and printing only; the arithmetic and the report text are in pagedllm/planner/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedllm import planner
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.units import format_size

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
  pagedllm plan --model path/to/target --draft-model default --num-speculative-tokens 4 \\
                --weight-dtype fp16 --memory 24GiB --seq-len 2048
      speculative decoding: the draft's weights and KV (in the same blocks) count against the budget
  pagedllm plan --model default --tensor-parallel-size 2 --weight-dtype fp16 --memory 2GiB --seq-len 4096
      tensor parallelism: weights and KV per device (--memory is one device's), users that fit

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
        "--num-heads",
        type=int,
        metavar="H",
        help="query heads, for --tensor-parallel-size without --model (with --d-model alone, or fewer KV heads "
        "than devices)",
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
    d = p.add_argument_group(
        "speculative decoding (a draft model runs beside the target, its KV in the same blocks)"
    )
    d.add_argument(
        "--draft-model",
        metavar="PATH|default",
        help="the draft: a Hugging Face folder, a .gguf file or 'default'; its KV and weights count too",
    )
    d.add_argument("--draft-weights", metavar="SIZE", help="memory the draft's weights take, e.g. 300MiB")
    d.add_argument(
        "--draft-weight-dtype",
        metavar="DTYPE",
        help="compute the draft's weights from its parameter count instead (default: --weight-dtype)",
    )
    d.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="N",
        help="tokens proposed a step: N more KV slots for every running request",
    )
    lo = p.add_argument_group("LoRA adapters (--enable-lora: their device slots and loaded copies)")
    lo.add_argument("--lora-rank", type=int, metavar="R", help="--max-lora-rank: every slot is this wide")
    lo.add_argument("--max-loras", type=int, metavar="N", help="adapter slots, as --max-loras (default 1)")
    lo.add_argument(
        "--max-cpu-loras", type=int, metavar="N", help="adapters kept loaded, float32 (default: --max-loras)"
    )
    t = p.add_argument_group("tensor parallelism (the model split over devices)")
    t.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="devices the model is split over: weights and KV per device, --memory and --overhead are a "
        "device's (default 1)",
    )
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


def plan_from_args(args: argparse.Namespace) -> dict:
    """The flags, and the config of --model when given, handed to the planner (pagedllm/planner/)."""
    config, path = load_model_config(args.model) if args.model else (None, None)
    draft_config, draft_path = None, None
    if args.draft_model:
        try:
            draft_config, draft_path = load_model_config(args.draft_model)
        except InputError as e:
            raise InputError(f"--draft-model: {e}", param="draft_model") from None
    return planner.build_plan(
        config=config,
        model=args.model,
        model_path=path,
        num_layers=args.num_layers,
        d_model=args.d_model,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_params=args.num_params,
        dtype=args.dtype,
        seq_len=args.seq_len,
        batch=args.batch,
        max_len=args.max_len,
        block_size=args.block_size,
        memory=args.memory,
        weights=args.weights,
        weight_dtype=args.weight_dtype,
        overhead=args.overhead,
        draft_config=draft_config,
        draft_model=args.draft_model,
        draft_model_path=draft_path,
        draft_weights=args.draft_weights,
        draft_weight_dtype=args.draft_weight_dtype,
        num_speculative_tokens=args.num_speculative_tokens,
        num_heads=args.num_heads,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_rank=args.lora_rank,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
    )


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({format_size(n)})"


def _none_fit(plan: dict) -> str | None:
    """When not one request fits the KV budget: what one needs, what is missing, and the longest request
    that does fit (whole blocks); None when one fits or no budget was given. Adds the bytes to `plan`."""
    if plan.get("max_concurrent_requests") != 0:
        return None
    # Under tensor parallelism the budget is a device's, and so are the request's and the block's bytes.
    need = plan.get("kv_bytes_reserved_per_request_per_device", plan["kv_bytes_reserved_per_request"])
    block, budget = plan.get("block_bytes_per_device", plan["block_bytes"]), plan["kv_budget_bytes"]
    plan["kv_bytes_missing"] = missing = need - budget
    spec = plan.get("num_speculative_tokens", 0) if "kv_slots_per_request" in plan else 0
    with_spec = f" (with its {spec} speculative slots)" if spec else ""
    if "tensor_parallel_size" in plan:
        with_spec += " on each device"
    line = (
        f"  none fit: one {plan['seq_len']}-token request{with_spec} needs {_bytes(need)} of KV cache, "
        f"{_bytes(missing)} more than the budget"
    )
    slots = budget // block * plan["block_size"]
    longest = slots - spec  # a running request keeps the speculative slots past its tokens
    if longest > 0:
        return line + f"; the budget holds one request of up to {longest} tokens (--seq-len {longest})"
    if slots:
        return line + f"; its {slots} slots do not hold one token and the {spec} speculative slots"
    return line + f"; it does not hold one block of {plan['block_size']} tokens"


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    none_fit = _none_fit(plan)
    if args.plot:
        from pagedllm.planner.plot import plot_plan  # matplotlib only when asked for

        plot_plan(plan, args.plot)
        plan["plot"] = args.plot
    if args.json:
        print(json.dumps(plan))
    else:
        print(planner.format_plan(plan))
        if none_fit:
            print(none_fit)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
