"""`pagedllm` command line: one module per subcommand, each with add_parser(subparsers) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedllm.errors import InputError
from pagedllm.version import __version__

# name -> module under pagedllm.entrypoints.cli; each module defines add_parser() and run().
SUBCOMMANDS = ["plan", "quant", "quantize", "generate", "chat", "bench", "serve", "eval", "env", "build_kernels"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage; we print one line and exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedllm",
        description=(
            "pagedllm: run and serve Llama-family language models from a paged KV cache, "
            "and explain their memory. Start with `pagedllm plan --model default`."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"pagedllm.entrypoints.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except InputError as e:
        sys.stderr.write(f"pagedllm {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
