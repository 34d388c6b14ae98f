"""`pagedllm eval perplexity`: perplexity of a model on a text file (GPTQ protocol)."""

from __future__ import annotations

import argparse
import json
import sys

from pagedllm.entrypoints.engine_args import add_model_args, add_quantization_arg, print_help

_EPILOG = """\
examples:
  pagedllm eval perplexity --model default --text ../shared/data/wikitext-2/test.txt --ctx 512
  pagedllm eval perplexity --model default --quantization int4 --text test.txt --max-windows 40 --json

The text is joined, tokenized once, cut into non-overlapping windows of --ctx tokens (the tail is
dropped); perplexity = exp(mean cross-entropy of every predicted token). Always quote the ctx with it.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval", help="evaluate a model (perplexity)", description="Model evaluation."
    )
    sub = parser.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND")
    p = sub.add_parser(
        "perplexity",
        help="perplexity on a text file, non-overlapping windows",
        description="Perplexity of a model on a text file, through the engine's paged attention path.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    add_quantization_arg(p, engine=False)  # the names build_model takes: no auto / none here
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache element type: auto, bf16, fp16, fp32, int8, fp8 (default: auto); "
        "it matters only with --chunk-size, when later chunks read K/V back from the cache",
    )
    p.add_argument("--chunk-size", type=int, default=None, help="prefill each window in chunks of N tokens")
    p.add_argument("--text", required=True, help="a UTF-8 text file, e.g. wikitext-2/test.txt")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default: 512)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run_perplexity)
    parser.set_defaults(run=lambda args: print_help(parser))
    return parser


def _work_note(num_ids: int, ctx: int, max_windows: int | None) -> str:
    """One line before a run that can take long: the tokens to score, and how to make it shorter."""
    from pagedllm.platform import capabilities

    windows = num_ids // ctx if max_windows is None else min(num_ids // ctx, max_windows)
    note = f"scoring {windows} windows of {ctx} tokens ({windows * ctx:,} of the text's {num_ids:,})"
    caps = capabilities()
    if not caps.at_least("avx512"):
        note += (
            f"; this may take long on this CPU ({caps.tier} tier, no AVX-512/AMX): "
            "--max-windows N scores only the first N windows"
        )
    return note


def run_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pagedllm.errors import InputError

    if not Path(args.text).is_file():  # before seconds of model loading
        raise InputError(f"--text {args.text} does not exist", param="text")

    from pagedllm.engine.llm_engine import resolve_dtype
    from pagedllm.eval.perplexity import perplexity, read_text_ids
    from pagedllm.model.build import build_model
    from pagedllm.model.loader import resolve_model_path
    from pagedllm.model.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    dtype = resolve_dtype(args.dtype)
    quiet = args.json
    model, _ = build_model(path, dtype, args.quantization, show_progress=not quiet)
    ids = read_text_ids(args.text, Tokenizer.from_checkpoint(path))
    if not quiet:
        sys.stderr.write(_work_note(len(ids), args.ctx, args.max_windows) + "\n")
    res = perplexity(
        model,
        ids,
        ctx=args.ctx,
        batch_size=args.batch_size,
        max_windows=args.max_windows,
        kv_cache_dtype=args.kv_cache_dtype,
        chunk_size=args.chunk_size,
        show_progress=not quiet,
    )
    if args.json:
        out = dict(res.to_dict(), model=args.model, dtype=str(dtype).removeprefix("torch."))
        out.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, text=args.text)
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        sys.stdout.write(
            f"perplexity {res.ppl:.4f} (ctx {res.ctx}, {res.num_windows} windows, "
            f"{res.num_tokens} predicted tokens, mean NLL {res.nll:.4f} nats)\n"
        )
    return 0
