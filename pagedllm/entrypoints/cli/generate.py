"""`pagedllm generate "PROMPT"`: one answer from the command line."""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for a prompt",
        description="Generate a continuation of PROMPT (or, with --chat, an assistant answer to it).",
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
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    add_engine_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    llm = LLM(**engine_kwargs(args), show_progress=False)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        out = llm.chat(messages, params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    sys.stdout.write(out[0].outputs[0].text + "\n")
    return 0
