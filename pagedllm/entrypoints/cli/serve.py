"""`pagedllm serve`: run the OpenAI-compatible HTTP server (see pagedllm/entrypoints/openai/server.py)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.entrypoints.cli.engine_args import add_engine_args
from pagedllm.entrypoints.cli.engine_args import engine_kwargs as shared_engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Server options, plus the engine options every command shares (engine_args.py)."""
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
    add_engine_args(parser)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize, /version.",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine keywords for the options that have a value (None = keep the engine's default)."""
    kwargs = {k: v for k, v in shared_engine_kwargs(args).items() if v is not None}
    kwargs.setdefault("show_progress", False)  # a server logs; no progress bars
    return kwargs


def make_engine(args: argparse.Namespace) -> Any:
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(**engine_kwargs(args))


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.server import run_server

    return run_server(args)
