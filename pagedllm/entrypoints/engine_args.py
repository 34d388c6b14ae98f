"""Engine options shared by `generate`, `chat`, `serve` and `bench`.

It sits in `entrypoints/`, not `entrypoints/cli/`, because both the CLI and the OpenAI server's
`python -m` entry point (openai/cli_args.py) build their parsers from it.
"""

from __future__ import annotations

import argparse


def print_help(parser: argparse.ArgumentParser) -> int:
    """What a command group (`eval`, `quant`) does when called without its subcommand."""
    parser.print_help()
    return 0


def add_model_args(g) -> None:
    """--model and --dtype: what every command that loads a model takes (engine commands, eval)."""
    g.add_argument(
        "--model",
        default="default",
        help="a GGUF file, a Hugging Face safetensors folder, or 'default' (SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="compute dtype; auto = bf16 where the CPU has native bf16 (AVX-512 BF16, AMX), else fp32 "
        "(default: auto; `pagedllm env` shows what this machine gets)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine options")
    add_model_args(g)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    g.add_argument(
        "--kv-cache-memory", default=None, help="memory for the KV cache, e.g. 512MiB or 2GiB (default: 1GiB)"
    )
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="number of KV blocks (overrides --kv-cache-memory)"
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default: 64)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step: prefill chunks plus decodes (default: 2048)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache element type: auto, bf16, fp16, fp32, or int8 / fp8 (quantized, per-token scales)",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        help="weights: auto (a GGUF file served from its own quantized blocks where a kernel runs here), "
        "none (dequantized to --dtype), gguf, or RTN at load: int8, int4, int4-g64, int4-g128 (default: auto)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )
