"""`pagedllm` command line: one module per subcommand, each with add_parser(subparsers) and run(args)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from pagedllm import cpu_bind
from pagedllm.entrypoints.engine_args import apply_threads
from pagedllm.errors import InputError
from pagedllm.version import __version__

# name -> module under pagedllm.entrypoints.cli; each module defines add_parser() and run().
SUBCOMMANDS = [
    "plan",
    "quant",
    "quantize",
    "generate",
    "chat",
    "bench",
    "serve",
    "eval",
    "env",
    "build_kernels",
]


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


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that args went through (`eval perplexity`: perplexity's)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's message for arguments nobody took, with the closest option of that subcommand for each
    mistyped --flag: the top-level parser reports them, and it does not know the subcommand's options."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in extras:
        if arg.startswith("--"):
            hints += difflib.get_close_matches(arg.split("=", 1)[0], options, n=1)
    message = f"unrecognized arguments: {' '.join(extras)}"
    return message + (f" (did you mean {', '.join(hints)}?)" if hints else "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # what parse_args() does, with a suggestion
        chosen = _chosen_parser(parser, args)
        chosen.error(_unrecognized(chosen, extras))
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        if hasattr(args, "threads"):  # a command that runs a model: PAGEDLLM_CPU_BIND=cores pins its threads
            cpu_bind.apply()  # before torch loads (libgomp reads its binding once)
        apply_threads(args)  # before run(): the thread pools must be sized before the model loads
        return int(args.run(args) or 0)
    except InputError as e:
        sys.stderr.write(f"pagedllm {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
