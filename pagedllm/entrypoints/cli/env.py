"""`pagedllm env`: what this machine is, what the engine picks on it, and why.

The CPU and its features, the tier the kernels are built for (PAGEDLLM_CPU_ISA caps it), the backend of
every op (ops.py), the dtype and quantization defaults this machine gets, and the kernel cache. With
--model, the model is built as the engine builds it and the report says what runs for it: the decoder
path (the fused stack, or the layer loop and why) and the kernel of every quantized linear.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedllm import cpp_extension, kernels, ops, platform

FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "env",
        help="this machine's CPU tier, the kernel chosen for each op, and the defaults it gets",
        description="Show the CPU and its features, the instruction-set tier the kernels are built for "
        "(cap it with PAGEDLLM_CPU_ISA=avx2|avx512|avx512_bf16|amx), the implementation chosen for each op, "
        "the dtype and quantization defaults and why, and the kernel cache. Builds any kernel not yet built.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--model",
        help="also build this model (default, a GGUF file or a HF folder) as the engine would and report "
        "what runs for it: the decoder path and each quantized linear's kernel",
    )
    p.add_argument(
        "--dtype", default="auto", help="the model's compute dtype, as the engine takes it (default: auto)"
    )
    p.add_argument(
        "--quantization",
        default="auto",
        help="as the engine takes it (default: auto; none dequantizes a GGUF)",
    )
    p.set_defaults(run=run)
    return p


def collect() -> dict[str, Any]:
    caps = platform.capabilities()
    table = ops.table()
    bf16 = caps.native_bf16
    gguf = table["quantized_linear"].backend in ("amx", "avx2")
    return {
        "cpu": caps.cpu_model,
        "features": {f: f in caps.flags for f in FEATURES},
        "tier": caps.tier,
        "detected_tier": caps.detected_tier,
        "capped_by": platform.ISA_ENV if caps.capped_by_env else None,
        "ops": {c.op: {"backend": c.backend, "detail": c.detail} for c in table.values()},
        "defaults": {
            "dtype": "bf16" if bf16 else "fp32",
            "dtype_why": "native bf16 dot products (avx512_bf16 / amx)"
            if bf16
            else "no native bf16 here: bf16 would be widened to fp32 for every product (slower, less exact)",
            "kv_cache_dtype": "bf16" if bf16 else "fp32",
            "gguf_quantization": "gguf" if gguf else "none",
            "gguf_why": f"served from its own blocks by the {table['quantized_linear'].backend} kernel"
            if gguf
            else "no quantized-linear kernel here: dequantized once at load",
        },
        "kernel_cache": str(cpp_extension.cache_root()),
        "kernels": {name: kernels.state(name) for name in kernels.KERNELS},
        "batch_invariant": dict(ops.BATCH_INVARIANT),  # what --batch-invariant runs instead, op by op
    }


def collect_model(model: str, dtype: str, quantization: str) -> dict[str, Any]:
    """What runs for this model on this machine: built by the engine's own function, then asked."""
    from collections import Counter

    from pagedllm.engine.llm_engine import resolve_dtype
    from pagedllm.model import decode_stack
    from pagedllm.model.build import load_model_for_inference, resolve_quantization
    from pagedllm.model.loader import resolve_model_path
    from pagedllm.quantization.linear import QuantLinear

    path = resolve_model_path(model)
    torch_dtype = resolve_dtype(dtype)
    quant = resolve_quantization(path, quantization)
    built, config = load_model_for_inference(path, torch_dtype, quant, show_progress=False)
    # what the engine's build left in place is what runs; supports() is asked only for the reason
    fused = built.decode_stack is not None
    reason = None if fused else decode_stack.supports(built)

    def kernel_name(m: QuantLinear) -> str:
        return m.kernel.name if m.kernel is not None else ops.REFERENCE

    linears = Counter(kernel_name(m) for m in built.modules() if isinstance(m, QuantLinear))
    head = built.lm_head
    return {
        "path": str(path),
        "architecture": config.architecture,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "quantization": quant or "none",
        "decoder_stack": {
            "backend": ops.backend("decoder_stack") if fused else ops.REFERENCE,
            "detail": "every decoder layer of a decode step in one C++ call"
            if fused
            else f"the model's layer loop: {reason}",
        },
        "quantized_linear": dict(sorted(linears.items())),
        "lm_head": type(head).__name__ + (f" ({kernel_name(head)})" if isinstance(head, QuantLinear) else ""),
    }


def format_env(info: dict[str, Any]) -> str:
    lines = [
        f"CPU            {info['cpu']}",
        "features       " + " ".join(f for f, on in info["features"].items() if on),
        f"tier           {info['tier']}"
        + (
            f" (capped by {info['capped_by']}; the CPU has {info['detected_tier']})"
            if info["capped_by"]
            else ""
        ),
        "",
        "op                 backend            what runs",
    ]
    for op, c in info["ops"].items():
        lines.append(f"{op:<18} {c['backend']:<18} {c['detail']}")
    d = info["defaults"]
    lines += [
        "",
        f"dtype auto     {d['dtype']} ({d['dtype_why']})",
        f"KV cache auto  {d['kv_cache_dtype']} (the compute dtype)",
        f"GGUF weights   --quantization auto = {d['gguf_quantization']} ({d['gguf_why']})",
        "",
        "--batch-invariant (every token a decode row; what it cannot make invariant is refused):",
        *(f"  {op + ':':<19} {detail}" for op, detail in info["batch_invariant"].items()),
        "",
        f"kernel cache   {info['kernel_cache']}",
    ]
    lines += [f"  {name:<14} {state}" for name, state in info["kernels"].items()]
    m = info.get("model")
    if m is not None:
        kernels_used = (
            ", ".join(f"{n} x {k}" for k, n in m["quantized_linear"].items()) or "none (float linears)"
        )
        lines += [
            "",
            f"model          {m['path']} ({m['architecture']}, {m['dtype']}, quantization {m['quantization']})",
            f"decoder_stack  {m['decoder_stack']['backend']}: {m['decoder_stack']['detail']}",
            f"quantized      {kernels_used}",
            f"lm_head        {m['lm_head']}",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.model is not None:
        info["model"] = collect_model(args.model, args.dtype, args.quantization)
    sys.stdout.write((json.dumps(info, indent=2) if args.json else format_env(info)) + "\n")
    return 0
