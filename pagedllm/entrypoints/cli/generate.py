"""`pagedllm generate "PROMPT"`: one answer from the command line, printed as it is generated."""

from __future__ import annotations

import argparse
import sys
from contextlib import closing

from pagedllm.entrypoints.engine_args import (
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    sampling_kwargs,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for a prompt",
        description="Generate a continuation of PROMPT (or, with --chat, an assistant answer to it), "
        "printed token by token as it is generated.",
        epilog='examples:\n  pagedllm generate "The capital of France is" --max-tokens 16 --temperature 0\n'
        '  pagedllm generate "Write a haiku about the sea" --chat',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    add_sampling_args(p)  # greedy by default: a continuation you can reproduce
    add_engine_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, **sampling_kwargs(args)
    )  # bad values: before the load
    llm = LLM(**engine_kwargs(args), show_progress=False)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        outputs = llm.stream_chat(messages, params)
    else:
        outputs = llm.stream(args.prompt, params)
    with closing(outputs):  # Ctrl-C (main() exits 130) aborts the request here, not at garbage collection
        for out in outputs:
            sys.stdout.write(out.outputs[0].text if out.outputs else "")
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
