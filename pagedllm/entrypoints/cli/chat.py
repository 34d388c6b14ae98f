"""`pagedllm chat`: an interactive conversation with the chat template applied, answers streamed."""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import closing

from pagedllm.entrypoints.engine_args import (
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    sampling_kwargs,
)

# llama.cpp's sampler chain, which keeps the 135M default model out of the loops that temperature 0.7 and
# top-p 0.9 alone fell into ("mon ami, mon ami, ..."): top-k 40, min-p 0.05, and a mild repetition penalty.
SAMPLING_DEFAULTS = dict(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.1)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "chat",
        help="talk with the model in the terminal",
        description="An interactive chat. Type a message and press Enter; the answer is printed as it is "
        "generated. Ctrl-C stops an answer; /reset clears the history, /quit (or Ctrl-D) leaves.",
    )
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default: 256)")
    add_sampling_args(p, **SAMPLING_DEFAULTS)
    add_engine_args(p)
    p.set_defaults(run=run)


def _banner(llm) -> str:
    engine = llm.llm_engine
    dtype = str(engine.dtype).removeprefix("torch.")
    quant = engine.quantization or f"none (weights in {dtype})"
    return (
        f"pagedllm chat: {engine.model_path}\n"
        f"  dtype {dtype}, quantization {quant}, context {engine.max_model_len} tokens\n"
        "  /reset clears the history, /quit or Ctrl-D leaves, Ctrl-C stops an answer\n"
    )


class _Interrupted:
    """A SIGINT handler for the time of one answer: it only raises a flag, which the answer loop reads
    between engine steps, so Ctrl-C never lands inside a step and leaves the engine half updated."""

    def __init__(self) -> None:
        self.hit = False

    def __call__(self, signum, frame) -> None:
        self.hit = True


def _answer(llm, history: list[dict], params) -> tuple[str, bool]:
    """Streams one answer to stdout; (its text, whether Ctrl-C stopped it)."""
    stop = _Interrupted()
    previous = signal.signal(signal.SIGINT, stop)
    text = ""
    try:
        sys.stdout.write("assistant> ")
        sys.stdout.flush()
        with closing(llm.stream_chat(history, params)) as outputs:  # closing aborts the engine request
            for out in outputs:
                piece = out.outputs[0].text if out.outputs else ""
                text += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
                if stop.hit:
                    break
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    return text, stop.hit


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, **sampling_kwargs(args)
    )  # bad values: before the load
    llm = LLM(**engine_kwargs(args), show_progress=False)
    sys.stderr.write(_banner(llm))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
            sys.stdout.write("\n")
            return 0
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history = list(system)
            sys.stderr.write("(history cleared)\n")
            continue
        history.append({"role": "user", "content": line})
        answer, interrupted = _answer(llm, history, params)
        # A stopped answer stays in the history as far as it got: the conversation goes on from what is on
        # the screen (/reset drops it).
        history.append({"role": "assistant", "content": answer})
        if interrupted:
            sys.stderr.write("(answer stopped)\n")
