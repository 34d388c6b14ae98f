"""`pagedllm bench throughput`: measure the engine, and the tools people use today in the same run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from pagedllm.entrypoints.cli.engine_args import add_engine_args, engine_kwargs
from pagedllm.errors import InputError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark throughput (offline)",
        description="Benchmarks. Figures are medians over --repeat runs.",
    )
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    t = sub.add_parser(
        "throughput",
        help="offline throughput, like `vllm bench throughput`",
        description="Submit every prompt at once and run them to the end; print requests/s and tokens/s.",
        epilog="example:\n  pagedllm bench throughput --dataset ../shared/bench/w32.jsonl --compare hf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "--dataset", default=None, help="JSONL ({prompt, max_tokens}), ShareGPT JSON, or one prompt a line"
    )
    t.add_argument("--num-prompts", type=int, default=None, help="how many prompts (random: default 32)")
    t.add_argument("--input-len", type=int, default=128, help="random prompt length in tokens (no --dataset)")
    t.add_argument("--output-len", type=int, default=128, help="tokens to generate per random prompt")
    t.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens (default: on)",
    )
    t.add_argument("--repeat", type=int, default=1, help="runs to take the median of (default: 1)")
    t.add_argument(
        "--compare",
        action="append",
        default=[],
        choices=["hf"],
        help="also run HF transformers (padded static batch) on the same prompts",
    )
    t.add_argument("--output-json", default=None, help="write the report here")
    add_engine_args(t)
    t.set_defaults(run=run_throughput)
    p.set_defaults(run=lambda args: p.print_help() or 0)


def run_throughput(args: argparse.Namespace) -> int:
    from pagedllm.bench.dataset import load_dataset, random_prompts
    from pagedllm.bench.throughput import run_offline, summarize
    from pagedllm.entrypoints.llm import LLM

    if args.repeat < 1:
        raise InputError(f"--repeat must be at least 1, got {args.repeat}")
    llm = LLM(**engine_kwargs(args), show_progress=False)
    if args.dataset:
        prompts = load_dataset(args.dataset, args.output_len, args.num_prompts)
    else:
        prompts = random_prompts(
            args.num_prompts or 32, args.input_len, args.output_len, llm.llm_engine.model_config.vocab_size
        )
    run_offline(llm, prompts[:2], args.ignore_eos, use_tqdm=False)  # warm-up
    runs = [summarize(run_offline(llm, prompts, args.ignore_eos)) for _ in range(args.repeat)]
    report = {"pagedllm": _median(runs)}
    for peer in args.compare:
        from pagedllm.bench.peers import hf_generate_throughput

        peer_runs = [
            summarize(hf_generate_throughput(llm.llm_engine.model_path, prompts, llm.llm_engine.dtype))
            for _ in range(args.repeat)
        ]
        report[peer] = _median(peer_runs)
        report[f"ratio_vs_{peer}"] = (
            report["pagedllm"]["output_tokens_per_second"] / report[peer]["output_tokens_per_second"]
        )
    for name, r in report.items():
        if isinstance(r, dict):
            print(
                f"{name:>10}: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.1f} total tokens/s, "
                f"{r['output_tokens_per_second']:.1f} output tokens/s ({r['elapsed_time']:.2f} s)"
            )
        else:
            print(f"{name}: {r:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    sys.stdout.flush()
    return 0


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
