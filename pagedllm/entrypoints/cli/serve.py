"""`pagedllm serve`: run the OpenAI-compatible HTTP server (see pagedllm/entrypoints/openai/server.py).

The options themselves are in openai/cli_args.py, which the server's own `python -m` entry point shares.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.entrypoints.openai.cli_args import add_arguments


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize, /version; in a browser, / (a chat page) and /kv (the "
        "paged KV cache, live). With --data-parallel-size N, N engine "
        "replicas run as Ray actors (a local Ray, or the cluster at --ray-address) behind this one front end.",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.server import run_server

    return run_server(args)
