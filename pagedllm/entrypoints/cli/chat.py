"""`pagedllm chat`: an interactive conversation with the chat template applied."""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "chat",
        help="talk with the model in the terminal",
        description="An interactive chat. Type a message and press Enter; /reset clears the history, "
        "/quit (or Ctrl-D) leaves.",
    )
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default: 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling threshold (default: 0.9)")
    add_engine_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args), show_progress=False)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    history = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            sys.stdout.write("\n")
            return 0
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        answer = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": answer})
        sys.stdout.write(f"assistant> {answer}\n")
