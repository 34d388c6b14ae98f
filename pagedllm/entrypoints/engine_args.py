"""Engine options shared by `generate`, `chat`, `serve` and `bench`.

It sits in `entrypoints/`, not `entrypoints/cli/`, because both the CLI and the OpenAI server's
`python -m` entry point (openai/cli_args.py) build their parsers from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from pagedllm.errors import InputError


def print_help(parser: argparse.ArgumentParser) -> int:
    """What a command group (`eval`, `quant`) does when called without its subcommand."""
    parser.print_help()
    return 0


class _ModelsAction(argparse.Action):
    """A repeatable --model (the server's several models): every value goes to `models`, in order, and
    `model` stays the first one, so that code reading args.model sees what a single --model gives."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        models = [*(getattr(namespace, "models", None) or []), values]
        namespace.models = models
        setattr(namespace, self.dest, models[0])


def add_model_args(g, several: bool = False) -> None:
    """--model, --dtype and --threads: what every command that loads a model takes (engine commands, eval).
    several: --model may be repeated (`pagedllm serve`; all of them in args.models)."""
    g.add_argument(
        "--model",
        default="default",
        action=_ModelsAction if several else "store",
        help="a GGUF file, a Hugging Face safetensors folder, or 'default' (SmolLM2-135M-Instruct)"
        + ("; repeat it, each as NAME=PATH if you like, to serve several models" if several else ""),
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="compute dtype; auto = bf16 where the CPU has native bf16 (AVX-512 BF16, AMX), else fp32 "
        "(default: auto; `pagedllm env` shows what this machine gets)",
    )
    add_threads_arg(g)


def add_threads_arg(g) -> None:
    """--threads; main() applies it (apply_threads) before the command runs, so before any model loads."""
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch and the kernels (default: torch's own choice, one per core)",
    )


def apply_threads(args: argparse.Namespace) -> None:
    """torch's thread counts from --threads (nothing without it). It must run before the model loads: the
    inter-op pool can be sized only before its first use; after that torch raises and keeps its size."""
    n = getattr(args, "threads", None)
    if n is None:
        return
    if n < 1:
        raise InputError(f"threads must be at least 1, got {n}", param="threads")
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # already started in this process (an engine made earlier): intra-op count only
        pass


class QuantizationNames(Sequence[str]):
    """A list of quantization names from model/build.py (ENGINE_QUANTIZATION_CHOICES, what the engine takes,
    or QUANTIZATION_CHOICES, what build_model takes), read on first use: argparse reads it only to check a
    value or print --help, and importing build.py imports torch (~2 s), which building the parser of every
    command (`pagedllm plan`, `pagedllm quant explain`) must not."""

    def __init__(self, constant: str) -> None:
        self.constant = constant

    @cached_property
    def names(self) -> tuple[str, ...]:
        from pagedllm.model import build

        return tuple(getattr(build, self.constant))

    def __getitem__(self, i):
        return self.names[i]

    def __len__(self) -> int:
        return len(self.names)


def add_quantization_arg(g, engine: bool = True) -> None:
    """--quantization, checked by argparse against the names the engine (or, engine=False, build_model)
    accepts, and listing them in its help; `eval` takes no auto / none."""
    choices = QuantizationNames("ENGINE_QUANTIZATION_CHOICES" if engine else "QUANTIZATION_CHOICES")
    text = "weights, one of %(choices)s: "
    if engine:
        text += "auto = a GGUF file served from its own quantized blocks where a kernel runs here, "
        text += "else as stored; none = dequantized to --dtype; "
    text += "gguf = a GGUF file's own blocks (Q4/Q5/Q8, Q4_K/Q5_K/Q6_K); the int ones = RTN at load (int8 per output "
    text += "channel, int4 = int4-g32: groups of 32 inputs) "
    text += "(default: auto)" if engine else "(default: the weights as stored)"
    g.add_argument(
        "--quantization", default="auto" if engine else None, choices=choices, metavar="NAME", help=text
    )


def add_sampling_args(
    parser: argparse.ArgumentParser,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> None:
    """Sampling flags of `generate` and `chat` (each passes its own defaults); sampling_kwargs() reads them
    back. SamplingParams checks the values (a bad one is an InputError naming the field: exit 2)."""
    g = parser.add_argument_group("sampling options")
    g.add_argument(
        "--temperature", type=float, default=temperature, help=f"0 = greedy (default: {temperature:g})"
    )
    g.add_argument(
        "--top-p", type=float, default=top_p, help=f"nucleus sampling threshold; 1 = off (default: {top_p:g})"
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=top_k,
        help=f"sample among the k most likely tokens; 0 = off (default: {top_k})",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=min_p,
        help=f"drop tokens less likely than min-p times the most likely one; 0 = off (default: {min_p:g})",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=repetition_penalty,
        help="divide the logits of tokens already in the prompt or the output by this; 1 = off "
        f"(default: {repetition_penalty:g})",
    )
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """SamplingParams keywords of the add_sampling_args flags."""
    return dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    g = parser.add_argument_group("engine options")
    add_model_args(g, several=several_models)
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
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: first come, first served (a request's priority must be 0); priority: requests rank by "
        "their priority field (lower first, vLLM's meaning), then arrival: the waiting queue is served in "
        "rank order and the lowest-ranked running request is preempted for a higher-ranked one when slots "
        "or KV blocks run out (default: fcfs)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache element type: auto, bf16, fp16, fp32, or int8 / fp8 (quantized, per-token scales)",
    )
    add_quantization_arg(g)
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s fields: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} (prompt lookup) or {"method": "draft_model", '
        '"model": PATH, "quantization": NAME, "num_speculative_tokens": 4} (a smaller model with the same '
        "vocabulary); greedy outputs stay the same token for token, sampled ones keep their distribution "
        "(default: off)",
    )
    g.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N worker processes on this machine (torch.distributed, gloo): heads, MLP "
        "and vocabulary, each rank with its share of the KV cache; --kv-cache-memory is per rank (default: 1)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's greedy tokens do not depend on what else runs in its steps (vLLM's "
        "VLLM_BATCH_INVARIANT): alone, in a batch, chunked, after a cached prefix, with speculative decoding "
        "or on a data-parallel replica; every token runs as a decode row on kernels whose row results do not "
        "depend on the batch. Refused with tensor parallelism, dense linears or a quantized KV cache "
        "(default: off)",
    )
    g.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="DIR",
        help="keep the prefix cache beyond the process: full cached blocks evicted from the KV cache, and all "
        "of them at shutdown, are written to DIR (keyed by their prefix hash and the model, KV dtype and "
        "block size); an engine started on the same DIR reads a prompt's blocks back instead of recomputing "
        "them. Several servers may share DIR (default: off)",
    )
    g.add_argument(
        "--kv-offload-max-bytes",
        default=None,
        metavar="SIZE",
        help="bound of --kv-offload-dir, e.g. 2GiB; the least recently used blocks are deleted past it "
        "(default: 10GiB)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLMEngine keywords. --threads is not one of them: it is process-wide (apply_threads)."""
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
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        batch_invariant=args.batch_invariant,
        scheduling_policy=args.scheduling_policy,
        kv_offload_dir=getattr(args, "kv_offload_dir", None),
        kv_offload_max_bytes=getattr(args, "kv_offload_max_bytes", None),
    )
