"""`pagedllm quantize`: weight-only RTN / AWQ / GPTQ quantization of a model into a loadable folder."""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedllm.entrypoints.engine_args import add_threads_arg

_EPILOG = """\
examples:
  pagedllm quantize --model default --method rtn --bits 4 --group-size 32 --out smollm2-int4
  pagedllm quantize --model default --method rtn --bits 8 --out smollm2-int8      (per output channel)
  pagedllm quantize --model default --method awq --bits 4 --calib wiki.txt --out smollm2-awq
  pagedllm quantize --model default --method gptq --calib wiki.txt --num-samples 8 --out smollm2-gptq
  pagedllm generate "Hello" --model smollm2-int4                                  (loads it quantized)

The folder holds config.json (with "quantization_config"), model.safetensors (per linear layer:
NAME.qweight / NAME.scales / NAME.zeros, w = scales * (q - zeros)) and the tokenizer files.
AWQ and GPTQ read --num-samples windows of --seq-len tokens of the --calib text file. GPTQ quantizes
columns in act-order (decreasing activation) by default; --no-act-order turns that off.
"""

METHODS = ("rtn", "awq", "gptq")


def _calibration_note(method: str, num_samples: int, seq_len: int, num_layers: int, num_linears: int) -> str:
    """One line before calibration, which can take long: the work, and how to make it shorter."""
    from pagedllm.platform import capabilities

    note = (
        f"{method}: calibrating {num_linears} linears in {num_layers} decoder layers, one layer at a time, "
        f"on {num_samples} samples x {seq_len} tokens"
    )
    caps = capabilities()
    if not caps.at_least("avx512"):
        note += (
            f"; this may take long on this CPU ({caps.tier} tier, no AVX-512/AMX): "
            "fewer --num-samples (e.g. 8) or a shorter --seq-len make it shorter"
        )
    return note


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quantize",
        help="quantize a model's linear weights (RTN, AWQ, GPTQ) and save a loadable folder",
        description="Weight-only quantization of every decoder linear layer; embeddings stay in float.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="default", help="a GGUF file, an HF folder, or 'default'")
    p.add_argument("--method", choices=METHODS, default="rtn", help="quantization method (default: rtn)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits per weight (default: 4)")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="G",
        help="weights per (scale, zero) group along the input; default 32 for 4 bits, per channel for 8",
    )
    p.add_argument("--calib", metavar="FILE", help="calibration text file (awq, gptq)")
    p.add_argument("--num-samples", type=int, default=64, help="calibration windows (default: 64)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default: 512)")
    p.add_argument(
        "--no-act-order",
        dest="act_order",
        action="store_false",
        help="gptq: quantize columns left to right instead of by decreasing activation (act-order, the default)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_threads_arg(p)
    p.set_defaults(run=run)
    return p


def _method_fn(method: str):
    """awq_quantize_model / gptq_quantize_model, imported only when asked for."""
    from pagedllm.errors import InputError

    try:
        module = importlib.import_module(f"pagedllm.quantization.{method}")
    except ModuleNotFoundError:
        raise InputError(f"method {method} is not available in this install", param="method") from None
    return getattr(module, f"{method}_quantize_model")


def run(args) -> int:
    from pathlib import Path

    import torch

    from pagedllm.errors import InputError
    from pagedllm.model.build import build_model
    from pagedllm.model.loader import resolve_model_path
    from pagedllm.model.quantized_checkpoint import save_quantized
    from pagedllm.quantization.linear import QuantLinear, check_layer_shape
    from pagedllm.quantization.model import (
        linear_layer_names,
        quantize_model,
        replace_linears,
        resident_weight_bytes,
    )

    group_size = args.group_size if args.group_size is not None else (32 if args.bits == 4 else None)
    if group_size is not None and group_size < 1:
        raise InputError(f"--group-size must be >= 1, got {group_size}", param="group_size")
    if not args.act_order and args.method != "gptq":
        raise InputError(
            f"--no-act-order applies to --method gptq only, not {args.method}", param="act_order"
        )
    if args.method != "rtn" and not args.calib:
        raise InputError(f"--method {args.method} needs --calib FILE (calibration text)", param="calib")
    if args.calib and not Path(args.calib).is_file():
        raise InputError(f"calibration file {args.calib} does not exist", param="calib")
    path = resolve_model_path(args.model)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise InputError(f"--out {out} exists and is not empty", param="out")
    show = not args.quiet
    # fp32: the methods' statistics and RTN's ranges come from full-precision weights.
    model, config = build_model(path, torch.float32, None, show_progress=show)
    if args.method == "rtn":
        quantize_model(model, args.bits, group_size, show_progress=show)
    else:
        fn = _method_fn(args.method)
        from pagedllm.model.tokenizer import Tokenizer
        from pagedllm.quantization.calib import load_calibration

        calib = load_calibration(args.calib, Tokenizer.from_checkpoint(path), args.num_samples, args.seq_len)
        if len(calib) < args.num_samples:
            raise InputError(f"calibration file {args.calib} is too short", param="calib")
        # check every layer shape first: a bad group size fails before minutes of calibration
        names = linear_layer_names(model)
        for name in names:
            check_layer_shape(name, model.get_submodule(name).in_features, args.bits, group_size)
        if show:
            note = _calibration_note(args.method, len(calib), args.seq_len, config.num_layers, len(names))
            sys.stderr.write(note + "\n")
        kwargs = {"act_order": args.act_order} if args.method == "gptq" else {}
        qts = fn(model, calib, bits=args.bits, group_size=group_size, show_progress=show, **kwargs)
        replace_linears(model, qts)
    save_quantized(model, out, path, args.method)
    n = sum(isinstance(m, QuantLinear) for m in model.modules())
    grouping = "per channel" if group_size is None else f"group {group_size}"
    mib = resident_weight_bytes(model) / 2**20
    sys.stdout.write(
        f"wrote {out}: {n} linear layers {args.method} {args.bits}-bit {grouping}; "
        f"resident weights {mib:.1f} MiB (embeddings and norms in fp32)\n"
    )
    return 0
