"""The server's command-line options and how they become an LLMEngine.

Shared by `pagedllm serve` (entrypoints/cli/serve.py) and `python -m pagedllm.entrypoints.openai.server`;
it lives here, below the CLI, so that the server never imports the CLI.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.entrypoints.engine_args import add_engine_args
from pagedllm.entrypoints.engine_args import engine_kwargs as shared_engine_kwargs


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
    add_engine_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine keywords for the options that have a value (None = keep the engine's default)."""
    kwargs = {k: v for k, v in shared_engine_kwargs(args).items() if v is not None}
    kwargs.setdefault("show_progress", False)  # a server logs; no progress bars
    return kwargs


def make_engine(args: argparse.Namespace) -> Any:
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(**engine_kwargs(args))
