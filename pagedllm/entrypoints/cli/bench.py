"""`pagedllm bench throughput | serve | memory`: measure the engine, and the tools people use today in the same run."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pagedllm.entrypoints.cli.bench_embed import add_embed_parser
from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from pagedllm.errors import InputError

PEERS = ["hf", "llama.cpp", "openvino", "llama-cpp-python"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark: offline throughput, online serving, KV-cache memory",
        description="Benchmarks, like `vllm bench`. Figures are medians over --repeat runs.",
    )
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_throughput(sub)
    _add_serve(sub)
    _add_memory(sub)
    add_embed_parser(sub)
    p.set_defaults(run=lambda args: p.print_help() or 0)


def _add_prompt_args(p: argparse.ArgumentParser, default_num: int) -> None:
    p.add_argument(
        "--dataset", default=None, help="JSONL ({prompt, max_tokens}), ShareGPT JSON, or one prompt a line"
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help=f"how many prompts (random: default {default_num})"
    )
    p.add_argument("--input-len", type=int, default=128, help="random prompt length in tokens (no --dataset)")
    p.add_argument(
        "--output-len", type=int, default=128, help="tokens to generate per prompt without max_tokens"
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens (default: on)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of random prompts and arrivals (default: 0)")
    p.add_argument("--output-json", default=None, help="write the report here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")


def _add_throughput(sub) -> None:
    t = sub.add_parser(
        "throughput",
        help="offline throughput, like `vllm bench throughput`",
        description="Submit every prompt at once and run them to the end; print requests/s and tokens/s.",
        epilog="example:\n  pagedllm bench throughput --dataset ../shared/bench/w32.jsonl --compare hf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_prompt_args(t, 32)
    t.add_argument("--repeat", type=int, default=1, help="runs to take the median of (default: 1)")
    t.add_argument(
        "--compare",
        action="append",
        default=[],
        choices=PEERS,
        help="also run a peer on the same prompt token ids, greedy, ignore-EOS, in the same run (may be "
        "repeated): hf (transformers generate, left-padded static batch, same dtype); llama.cpp (llama.cpp's "
        "own llama-server on the same GGUF: one slot per prompt, continuous batching, all requests at once; "
        "build it with scripts/build_llama_server.sh); openvino (OpenVINO GenAI ContinuousBatchingPipeline "
        "reading the GGUF; pip install openvino-genai); llama-cpp-python (the Python binding in process, one "
        "request at a time and as one low-level batch)",
    )
    t.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        help="threads of llama.cpp and OpenVINO (default: --threads, else 2): the same count as ours",
    )
    t.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="the llama-server binary for --compare llama.cpp (default: $PAGEDLLM_LLAMA_SERVER, else the "
        "build script's ~/.cache/pagedllm/llama.cpp/<version>/bin/llama-server)",
    )
    t.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|builtin",
        help="also run every prompt constrained by this JSON schema (builtin: bench/structured.py, a list of "
        "records no request can finish within max_tokens), alternating with the unconstrained runs; reports "
        "both, the ratio, and the schema's compile time",
    )
    add_engine_args(t)
    t.set_defaults(run=run_throughput)


def _add_serve(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="online serving latency and throughput, like `vllm bench serve`",
        description="Stream requests at an OpenAI-compatible server (Poisson arrivals, bounded concurrency); "
        "report TTFT, TPOT, ITL and E2EL (mean/median/p99) and throughput.",
        epilog="examples:\n  pagedllm bench serve --base-url http://127.0.0.1:8000 --model default --num-prompts 64\n"
        "  pagedllm bench serve --launch --max-concurrency 1 4 16 --plot-dir out/plots",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_prompt_args(s, 64)
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark")
    s.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    s.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    s.add_argument("--served-model-name", default=None, help="model name in requests (default: --model)")
    s.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)"
    )
    s.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        default=[None],
        help="most requests in flight; several values run one after another (a sweep)",
    )
    s.add_argument(
        "--launch", action="store_true", help="start `pagedllm serve` with the engine options on a free port"
    )
    add_engine_args(s)
    s.set_defaults(run=run_serve)


def _add_memory(sub) -> None:
    m = sub.add_parser(
        "memory",
        help="how many requests a KV budget holds: paged vs max-length reservation, shared prefix",
        description="Allocate a seeded length mix through the engine's real KVCacheManager (no model run) "
        "until the cache is full, paged and with max_model_len reserved per request; then N requests "
        "sharing a system prompt with and without prefix caching. Each figure beside the planner's.",
    )
    m.add_argument("--num-requests", type=int, default=256, help="requests in the length mix (default: 256)")
    m.add_argument("--min-len", type=int, default=50, help="shortest prompt+output (default: 50)")
    m.add_argument("--max-len", type=int, default=2000, help="longest prompt+output (default: 2000)")
    m.add_argument(
        "--prefix-requests", type=int, default=16, help="requests sharing the prefix (default: 16)"
    )
    m.add_argument("--prefix-len", type=int, default=200, help="shared system prompt tokens (default: 200)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--output-json", default=None, help="write the report here")
    m.add_argument("--plot-dir", default=None, help="write PNG plots here")
    add_engine_args(m)
    m.set_defaults(run=run_memory)


def _prompts(args: argparse.Namespace, default_num: int, vocab_size: int):
    from pagedllm.bench.dataset import load_dataset, random_prompts

    if args.num_prompts is not None and args.num_prompts < 1:
        raise InputError(f"--num-prompts must be at least 1, got {args.num_prompts}", param="num_prompts")
    if args.dataset:
        return load_dataset(args.dataset, args.output_len, args.num_prompts)
    return random_prompts(
        args.num_prompts or default_num, args.input_len, args.output_len, vocab_size, args.seed
    )


def _plot_labels(args: argparse.Namespace, engine=None) -> dict[str, str]:
    """What a plot's title names: the model, and the dtype and quantization the engine actually runs (the
    flags' values when no engine is at hand, as for `bench serve`)."""
    if engine is None:
        return {"model": args.model, "dtype": args.dtype, "quantization": args.quantization}
    return {
        "model": args.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization or "none",
    }


def _write_json(path: str | None, report: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


# ---- throughput ---------------------------------------------------------------------------------------
def run_throughput(args: argparse.Namespace) -> int:
    import time

    from pagedllm.bench.report import memory_read_gbps, torch_threads
    from pagedllm.bench.roofline import format_roofline
    from pagedllm.bench.throughput import run_offline, summarize
    from pagedllm.entrypoints.llm import LLM

    if args.repeat < 1:
        raise InputError(f"--repeat must be at least 1, got {args.repeat}")
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args), show_progress=False)
    load_time_s = time.perf_counter() - start  # start to ready: the model built and loaded, the engine warm
    engine = llm.llm_engine
    # the roofline's read bandwidth, once, before the runs: on this process's torch threads, the runs' own
    # (--threads, else OMP_NUM_THREADS)
    read = {"memory_read_gbps": memory_read_gbps(), "memory_read_threads": torch_threads()}
    prompts = _prompts(args, 32, engine.model_config.vocab_size)
    constraint = None
    if args.json_schema:
        from pagedllm.bench.structured import compile_times, load_schema
        from pagedllm.sampling_params import StructuredOutputsParams

        constraint = StructuredOutputsParams(json=load_schema(args.json_schema))
        times = compile_times(engine, constraint)
        print(
            f"grammar: tokenizer indexed in {times['grammar_tokenizer_s'] * 1000:.0f} ms (once per engine), "
            f"schema compiled in {times['grammar_compile_s'] * 1000:.1f} ms (once per schema)"
        )
    run_offline(llm, prompts[:2], args.ignore_eos, use_tqdm=False)  # warm-up
    runs, constrained = [], []
    for _ in range(args.repeat):  # alternated, so that both see the same machine
        runs.append(summarize(run_offline(llm, prompts, args.ignore_eos)))
        if constraint is not None:
            constrained.append(
                summarize(run_offline(llm, prompts, args.ignore_eos, structured_outputs=constraint))
            )
    report: dict = {"pagedllm": _median(runs) | {"load_time_s": load_time_s}}
    if constrained:
        report["pagedllm+json"] = {**_median(constrained), **times}
    for peer in dict.fromkeys(args.compare):  # once each, in the order given
        report.update(_run_peer(peer, engine, prompts, args))
    for name in [k for k, v in report.items() if isinstance(v, dict) and k != "pagedllm"]:
        report[f"ratio_vs_{name}"] = (
            report["pagedllm"]["output_tokens_per_second"] / report[name]["output_tokens_per_second"]
        )
    print(_format_throughput(report))
    print(format_roofline(report, read["memory_read_gbps"], read["memory_read_threads"]))
    # vLLM's flat keys at the top (ours), each system's full figures and the ratios beside them
    labels = _plot_labels(args, engine)
    # the labels and the bandwidth go into the JSON (which `bench report` re-plots from), not into `report`,
    # whose other top-level values are all ratios
    _write_json(args.output_json, {**report["pagedllm"], **report, **labels, **read})
    if args.plot_dir:
        from pagedllm.bench.plots import plot_offline

        stem = Path(args.dataset).stem if args.dataset else "random"
        path = Path(args.plot_dir) / f"offline_{stem}.png"
        print(f"plot: {plot_offline(report, path, f'{stem}: output tokens/s', **labels)}")
    sys.stdout.flush()
    return 0


def _run_peer(peer: str, engine, prompts, args) -> dict:
    """{row name: median run} for one peer; {} with a printed line when it cannot run or fails (the
    other systems' figures are still worth reporting)."""
    from pagedllm.bench.throughput import summarize

    model_path = engine.model_path
    if peer == "hf":
        from pagedllm.bench.peers import hf_generate_throughput

        runs = hf_generate_throughput(model_path, prompts, engine.dtype, repeat=args.repeat)
        return {"hf": _median([summarize(r) for r in runs])}
    reason = _peer_unavailable(peer, model_path, args)
    if reason:
        print(f"{peer}: skipped: {reason}")
        return {}
    try:
        rows = _peer_runs(peer, model_path, prompts, args)
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"{peer}: failed: {type(e).__name__}: {e}")
        return {}
    return {name: _median([summarize(r) for r in runs]) for name, runs in rows.items()}


def _peer_unavailable(peer: str, model_path: Path, args) -> str | None:
    if peer == "llama.cpp":
        from pagedllm.bench import llamacpp_server

        return llamacpp_server.unavailable_reason(llamacpp_server.binary_path(args.llama_server), model_path)
    if peer == "openvino":
        from pagedllm.bench import openvino

        return openvino.unavailable_reason(model_path)
    from pagedllm.bench import llamacpp

    return llamacpp.unavailable_reason(model_path)


def _peer_runs(peer: str, model_path: Path, prompts, args) -> dict[str, list[dict]]:
    """{row name: [run, ...]}: llama-cpp-python gives two rows (one at a time, one batch)."""
    threads = args.peer_threads or getattr(args, "threads", None) or 2
    if peer == "llama.cpp":
        from pagedllm.bench import llamacpp_server

        binary = llamacpp_server.binary_path(args.llama_server)
        return {
            "llama.cpp": llamacpp_server.run_llama_server(
                binary, model_path, prompts, threads, args.repeat
            )
        }
    if peer == "openvino":
        from pagedllm.bench import openvino

        return {"openvino": openvino.run_openvino(model_path, prompts, threads, args.repeat)}
    from pagedllm.bench import llamacpp

    return llamacpp.run_llamacpp(model_path, prompts, threads, args.repeat)


def _format_throughput(report: dict) -> str:
    lines = []
    for name, r in report.items():
        if isinstance(r, dict):
            line = (
                f"{name:>16}: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.1f} total "
                f"tokens/s, {r['output_tokens_per_second']:.1f} output tokens/s ({r['elapsed_time']:.2f} s)"
            )
            if r.get("num_requests") == 1 and "median_ttft_s" in r:
                line += f"; TTFT {r['median_ttft_s'] * 1000:.0f} ms, decode {r['decode_tokens_per_second']:.1f} tok/s"
            if "mean_acceptance_length" in r:
                line += (
                    f"; speculation: {r['spec_decode_num_drafts']:.0f} drafts, acceptance "
                    f"{r['spec_decode_acceptance_rate']:.2f}, mean acceptance length {r['mean_acceptance_length']:.2f}"
                )
            lines.append(line)
        else:
            lines.append(f"{name}: {r:.2f}x")
    return "\n".join(lines)


def _median(runs: list[dict]) -> dict:
    """The median run by elapsed time (of two middle runs, the slower), whole: a median taken per key would
    pair one run's time with another run's rate, and the figures would not agree with each other."""
    run = sorted(runs, key=lambda r: r["elapsed_time"])[len(runs) // 2]
    return {k: v for k, v in run.items() if isinstance(v, (int, float))}


# ---- serve --------------------------------------------------------------------------------------------
def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine options as `pagedllm serve` flags, for --launch."""
    kw = engine_kwargs(args)
    flags = []
    for key, value in kw.items():
        if key == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif isinstance(value, bool):  # a store_true flag: named when on
            flags += [f"--{key.replace('_', '-')}"] if value else []
        elif value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def run_serve(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from pagedllm.bench.launch import launched_server
    from pagedllm.bench.serve import format_report
    from pagedllm.bench.serve import run_serve as bench

    if args.request_rate <= 0:
        raise InputError(f"--request-rate must be positive, got {args.request_rate}", param="request_rate")
    if any(c is not None and c < 1 for c in args.max_concurrency):
        raise InputError("--max-concurrency must be at least 1", param="max_concurrency")
    prompts = _prompts(args, 64, _vocab_size(args.model))
    if args.endpoint.endswith("chat/completions"):
        prompts = _as_text(prompts, args.model)
    name = args.served_model_name or args.model
    server = launched_server(_engine_flags(args)) if args.launch else nullcontext(args.base_url)
    runs = []
    with server as base_url:
        for conc in args.max_concurrency:
            r = asyncio.run(
                bench(
                    base_url,
                    args.endpoint,
                    name,
                    prompts,
                    args.request_rate,
                    conc,
                    args.ignore_eos,
                    args.api_key,
                    args.seed,
                )
            )
            print(format_report(r))
            runs.append(r)
    report = runs[0] if len(runs) == 1 else {"runs": runs}
    _write_json(args.output_json, report)
    if args.plot_dir:
        from pagedllm.bench.plots import plot_concurrency, plot_latency

        d = Path(args.plot_dir)
        labels = {k: v for k, v in _plot_labels(args).items() if k != "model"}  # the runs name the model
        print(f"plot: {plot_latency(runs, d / 'serve_latency.png', **labels)}")
        if len(runs) > 1:
            print(f"plot: {plot_concurrency(runs, d / 'serve_concurrency.png', **labels)}")
    return 1 if any(r["failed"] for r in runs) else 0


def _as_text(prompts, model: str):
    """Chat messages carry text: decode random token prompts with the model's tokenizer."""
    from pagedllm.bench.dataset import BenchPrompt
    from pagedllm.model.loader import resolve_model_path
    from pagedllm.model.tokenizer import Tokenizer

    if all(isinstance(p.prompt, str) for p in prompts):
        return prompts
    tok = Tokenizer.from_checkpoint(resolve_model_path(model))
    return [
        BenchPrompt(p.prompt if isinstance(p.prompt, str) else tok.decode(p.prompt), p.max_tokens)
        for p in prompts
    ]


def _vocab_size(model: str) -> int:
    """Random token prompts need the vocabulary size: from the model's metadata when it is local."""
    from pagedllm.model.loader import read_model_config, resolve_model_path

    try:
        return read_model_config(resolve_model_path(model)).vocab_size
    except InputError:
        return read_model_config(resolve_model_path("default")).vocab_size


# ---- memory -------------------------------------------------------------------------------------------
def run_memory(args: argparse.Namespace) -> int:
    from pagedllm.bench.memory import format_report
    from pagedllm.bench.memory import run_memory as bench
    from pagedllm.engine.llm_engine import LLMEngine

    if args.min_len < 2 or args.max_len < args.min_len:
        raise InputError("need 2 <= --min-len <= --max-len", param="min_len")
    engine = LLMEngine(**engine_kwargs(args), show_progress=False)
    report = bench(
        engine,
        args.num_requests,
        args.min_len,
        args.max_len,
        args.prefix_requests,
        args.prefix_len,
        args.seed,
    )
    print(format_report(report))
    _write_json(args.output_json, report)
    if args.plot_dir:
        from pagedllm.bench.plots import plot_memory

        path = Path(args.plot_dir) / "memory.png"
        print(f"plot: {plot_memory(report, path, **_plot_labels(args, engine))}")
    return 0
