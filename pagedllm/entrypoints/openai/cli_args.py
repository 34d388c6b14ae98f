"""The server's command-line options and how they become an LLMEngine.

Shared by `pagedllm serve` (entrypoints/cli/serve.py) and `python -m pagedllm.entrypoints.openai.server`;
it lives here, below the CLI, so that the server never imports the CLI.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.engine_args import add_engine_args, apply_threads
from pagedllm.entrypoints.engine_args import engine_kwargs as shared_engine_kwargs
from pagedllm.entrypoints.openai.limits import HTTPLimits
from pagedllm.entrypoints.openai.lora_args import add_lora_args, lora_engine_kwargs
from pagedllm.entrypoints.openai.model_specs import add_model_router_args
from pagedllm.entrypoints.reasoning import REASONING_PARSERS
from pagedllm.errors import InputError
from pagedllm.structured_output.config import FLAG as SO_CONFIG_FLAG
from pagedllm.structured_output.config import parse_structured_outputs_config
from pagedllm.units import format_size, parse_size

if TYPE_CHECKING:
    from pagedllm.engine.async_pooling import AsyncPoolingEngine
    from pagedllm.engine.llm_engine import LLMEngine

# (flag, HTTPLimits field, help): the connection timeouts, in seconds
TIMEOUT_FLAGS = [
    ("--timeout-header", "header_timeout", "seconds a client has to send a request's line and headers"),
    ("--timeout-body", "body_timeout", "longest pause, in seconds, within a request body before 408"),
    ("--timeout-keep-alive", "keep_alive_timeout", "seconds an idle keep-alive connection stays open"),
    (
        "--timeout-write",
        "write_timeout",
        "seconds a response may wait on a client that reads nothing before it is ended and its requests "
        "aborted",
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Server options, plus the engine options every command shares (entrypoints/engine_args.py)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* routes")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on shutdown before they are aborted (default: 10)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "json"],
        help="how tool calls are read from the model's text when tool_choice is auto: hermes "
        "(<tool_call>{...}</tool_call>, the fallback prompt's convention) or json (the whole output is "
        "the call); default: %(default)s",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a reasoning model's <think> block from its answer: chat completions' "
        "message.reasoning_content (delta.reasoning_content streamed); a request's output constraint then "
        "starts after the block (default: none)",
    )
    parser.add_argument(
        SO_CONFIG_FLAG,
        default=None,
        metavar="JSON",
        help="vLLM's structured outputs options as JSON, e.g. '{\"enable_in_reasoning\": true}' (a "
        "constraint applies to the whole output, think block included); keys: enable_in_reasoning, backend "
        "(auto / guidance), reasoning_parser",
    )
    parser.add_argument(
        "--kv-debug-routes",
        action="store_true",
        help="tests only: add POST /kv/debug/hold, which stops the engine between two steps and returns "
        "its KVCacheManager's state; never on a server others use",
    )
    parser.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="auto: an embedding or cross-encoder folder (sentence-transformers, BERT, XLM-R) is served by the "
        "pooling engine (/v1/embeddings, /v1/rerank, /score), anything else generates; pooling: pool a "
        "decoder's last token as an embedder (default: %(default)s)",
    )
    g = parser.add_argument_group("limits (what one client may cost the server)")
    d = HTTPLimits()
    g.add_argument(
        "--max-request-body",
        default=format_size(d.max_body_bytes),
        help="largest request body; a bigger one gets 413 before it is read (default: %(default)s)",
    )
    g.add_argument(
        "--max-num-waiting",
        type=int,
        default=256,
        help="most sequences waiting for a place in the batch; a request beyond it gets 503 with "
        "Retry-After instead of queueing behind everyone (default: %(default)s; 0 = no bound)",
    )
    for flag, field, text in TIMEOUT_FLAGS:
        g.add_argument(flag, type=float, default=getattr(d, field), help=f"{text} (default: %(default)s)")
    dp = parser.add_argument_group("data parallelism (engine replicas on Ray; pip install 'pagedllm[ray]')")
    dp.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas, each a Ray actor in its own process with its own engine, behind this one "
        "front end; a request goes to the replica that already holds its prefix, else the least loaded "
        "(default: 1, no Ray)",
    )
    dp.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join the Ray cluster at ADDR (host:port of its head) instead of starting a local Ray",
    )
    dp.add_argument(
        "--replica-num-cpus",
        type=float,
        default=1.0,
        metavar="N",
        help="CPUs Ray reserves for each replica; also its torch threads unless --threads says (default: 1)",
    )
    add_model_router_args(parser)
    add_engine_args(parser, several_models=True)
    add_lora_args(parser)


def http_limits(args: argparse.Namespace) -> HTTPLimits:
    """The limits flags, checked: each must be positive (InputError naming the flag)."""
    max_body = parse_size(args.max_request_body, "--max-request-body")
    timeouts = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field, _ in TIMEOUT_FLAGS}
    values = {"--max-request-body": max_body, **{flag: timeouts[field] for flag, field, _ in TIMEOUT_FLAGS}}
    for flag, value in values.items():
        if not value > 0 or value == float("inf"):
            raise InputError(f"{flag} must be a positive finite number, got {value}", param=flag)
    if args.max_num_waiting < 0:
        raise InputError(
            f"--max-num-waiting must be >= 0, got {args.max_num_waiting}", param="--max-num-waiting"
        )
    if args.max_num_waiting == 0:
        args.max_num_waiting = None
    return HTTPLimits(max_body_bytes=int(max_body), **timeouts)


def reasoning_options(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(reasoning parser, enable_in_reasoning) from --reasoning-parser and --structured-outputs-config
    (InputError naming the flag when they are malformed or disagree)."""
    config = parse_structured_outputs_config(getattr(args, "structured_outputs_config", None))
    parser = getattr(args, "reasoning_parser", None)
    if config.reasoning_parser and parser and config.reasoning_parser != parser:
        raise InputError(
            f"{SO_CONFIG_FLAG} names reasoning_parser {config.reasoning_parser!r}, --reasoning-parser {parser!r}",
            param=SO_CONFIG_FLAG,
        )
    parser = parser or config.reasoning_parser
    if parser is not None and parser not in REASONING_PARSERS:
        raise InputError(
            f"{SO_CONFIG_FLAG}: unknown reasoning_parser {parser!r} (known: {', '.join(REASONING_PARSERS)})",
            param=SO_CONFIG_FLAG,
        )
    return parser, config.enable_in_reasoning


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine keywords for the options that have a value (None = keep the engine's default)."""
    kwargs = {k: v for k, v in shared_engine_kwargs(args).items() if v is not None}
    kwargs.update(lora_engine_kwargs(args))  # --enable-lora and its limits (lora_serving.py)
    kwargs.setdefault("show_progress", False)  # a server logs; no progress bars
    return kwargs


def make_engine(args: argparse.Namespace) -> LLMEngine:
    from pagedllm.engine.llm_engine import LLMEngine

    apply_threads(args)  # `python -m ...server` does not pass through the CLI's main, which applies it
    return LLMEngine(**engine_kwargs(args))


def make_pooling_engine(args: argparse.Namespace) -> AsyncPoolingEngine | None:
    """The pooling engine when --model is an embedding / scoring model (or --runner pooling), else None."""
    from pagedllm.engine.async_pooling import AsyncPoolingEngine
    from pagedllm.engine.pooling_engine import PoolingEngine, is_pooling_model

    if not is_pooling_model(args.model, args.runner):
        return None
    _refuse_generative_options(args)
    apply_threads(args)
    engine = PoolingEngine(
        args.model,
        args.dtype,
        args.runner,
        args.max_num_batched_tokens,
        args.max_num_seqs,
        args.max_model_len,
    )
    return AsyncPoolingEngine(engine, max_num_waiting=args.max_num_waiting)


# The generative engine's options, which a pooling model has no use for (no KV cache, one process): set to
# anything but their default they are refused by name, never ignored.
GENERATIVE_ONLY_OPTIONS = (
    "tensor_parallel_size",
    "data_parallel_size",
    "ray_address",
    "speculative_config",
    "kv_cache_dtype",
    "kv_cache_memory",
    "num_kv_blocks",
    "block_size",
    "quantization",
    "scheduling_policy",
    "batch_invariant",
    "no_prefix_caching",
    "enable_lora",
    "lora_modules",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "allow_runtime_lora_updating",
    "kv_offload_dir",
    "kv_offload_max_bytes",
)


def _refuse_generative_options(args: argparse.Namespace) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    for dest in GENERATIVE_ONLY_OPTIONS:
        if hasattr(args, dest) and getattr(args, dest) != getattr(defaults, dest):
            flag = "--" + dest.replace("_", "-")
            raise InputError(f"{flag} does not apply to an embedding / scoring model: leave it unset", param=flag)


def uses_ray(args: argparse.Namespace) -> bool:
    """Whether the options ask for engine replicas on Ray (checked: InputError naming the flag, with exit 2
    from the CLI, when N < 1 or ray is not installed)."""
    size = getattr(args, "data_parallel_size", 1)
    if size < 1:
        raise InputError(f"--data-parallel-size must be at least 1, got {size}", param="--data-parallel-size")
    address = getattr(args, "ray_address", None)
    if size == 1 and not address:
        return False
    cpus = getattr(args, "replica_num_cpus", 1.0)
    if not cpus > 0 or cpus == float("inf"):
        raise InputError(
            f"--replica-num-cpus must be a positive number, got {cpus}", param="--replica-num-cpus"
        )
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        flag = "--data-parallel-size" if size > 1 else "--ray-address"
        raise InputError(f"{flag} needs ray: pip install 'pagedllm[ray]' (or ray>=2.9)", param=flag)
    return True


def make_data_parallel_engine(args: argparse.Namespace) -> EngineClient:
    """A DataParallelEngine of --data-parallel-size replicas, each built from the same engine options."""
    from pagedllm.engine.data_parallel import DataParallelEngine

    if getattr(args, "kv_offload_dir", None) is not None:
        raise InputError(
            "--kv-offload-dir is not supported with --data-parallel-size > 1 or --ray-address",
            param="--kv-offload-dir",
        )
    return DataParallelEngine(
        engine_kwargs(args),
        args.data_parallel_size,
        ray_address=args.ray_address,
        max_num_waiting=args.max_num_waiting,
        num_cpus_per_replica=args.replica_num_cpus,
        threads=args.threads,
    )
