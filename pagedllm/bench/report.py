"""Render docs/benchmarks.md from the JSON reports scripts/bench_all.sh writes (one command regenerates all).

python -m pagedllm.bench.report machine out/bench/machine.json      # before the runs (THREADS: a 3rd arg)
python -m pagedllm.bench.report render out/bench docs/benchmarks.md  # after them
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

from pagedllm.bench.roofline import roofline_figures

SYSTEMS = {
    "pagedllm": "pagedllm (continuous batching)",
    "hf": "HF transformers `generate`, same dtype, left-padded static batch",
    "llama.cpp": "llama.cpp `llama-server`, Q4_1, one slot per prompt, continuous batching, all requests at once",
    "openvino": "OpenVINO GenAI `ContinuousBatchingPipeline` reading the Q4_1 GGUF",
    "llama-cpp-python": "llama-cpp-python, Q4_1, one request at a time",
    "llama-cpp-python-batch": "llama-cpp-python, Q4_1, all prompts as one batch",
}
FLAGS = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"]


def memory_read_gbps(megabytes: int = 512, repeats: int = 5, threads: int | None = None) -> float:
    """How fast this machine reads memory right now, in GB/s: torch's sum over a float32 buffer larger
    than the caches, the median of a few. On a shared VM it moves with the neighbours' load (over 400 MB
    on the 2-core VM of docs/performance.md: 21.6 GB/s one hour, 16.7 the next), and every absolute figure
    of a benchmark with it; the ratios measured in the same run do not.

    It runs on `threads` threads (default: torch's own count, which is the benchmark's: --threads, else
    OMP_NUM_THREADS). The count matters: one core cannot saturate the memory bus, so a probe on other
    threads than the decode it is the roofline of would set the wrong roof."""
    import torch  # here, not at the top: rendering a report needs no torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        x = torch.ones(megabytes * 2**20 // 4)
        x.sum()  # pages touched once before timing
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / sorted(times)[repeats // 2] / 1e9


def torch_threads() -> int:
    """The threads torch runs on in this process (what memory_read_gbps uses by default)."""
    import torch

    return torch.get_num_threads()


def machine_info(probe_memory: bool = True, threads: int | None = None) -> dict:
    """CPU model, cores, the SIMD flags that decide bf16 speed, library versions, load and memory read
    speed right now on `threads` threads (default: torch's; the probe takes about a second)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    versions = {}
    for pkg in ("torch", "transformers", "llama_cpp_python", "openvino_genai"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": model,
        "cores": os.cpu_count(),
        "flags": [f for f in FLAGS if f in flags],
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_1m": os.getloadavg()[0],
        "memory_read_gbps": memory_read_gbps(threads=threads) if probe_memory else None,
        "memory_read_threads": (threads or torch_threads()) if probe_memory else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "llama_server": _llama_server_version(),
    }


def _llama_server_version() -> str | None:
    """`llama-server --version` of the binary `--compare llama.cpp` would run, or None without one."""
    import subprocess

    from pagedllm.bench.llamacpp_server import binary_path, library_env

    binary = binary_path()
    if not binary.is_file():
        return None
    try:
        r = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, env=library_env(binary)
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("version")]
    return lines[0] if lines else None


def _memory_speed_line(start: dict, end: dict) -> list[str]:
    if start.get("memory_read_gbps") is None:
        return []
    at_end = end.get("memory_read_gbps")
    threads = start.get("memory_read_threads")
    on = f" on {threads} threads, the benchmarks' own count" if threads else ""
    return [
        f"- memory read speed (`torch.sum` over 512 MB{on}): {start['memory_read_gbps']:.1f} GB/s at the start"
        + (f" and {at_end:.1f} at the end" if at_end is not None else "")
        + ": on this shared VM it moves with other tenants' load, and every absolute figure below with it."
    ]


def _read_bandwidth(run: dict, machine: dict) -> tuple[float | None, int | None]:
    """(GB/s, threads) a run's roofline is drawn at: the bandwidth its own bench process measured, else
    the machine probe's at the start of `make bench` (on the same OMP_NUM_THREADS as the runs)."""
    if run.get("memory_read_gbps"):
        return run["memory_read_gbps"], run.get("memory_read_threads")
    return machine.get("memory_read_gbps"), machine.get("memory_read_threads")


def _load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.is_file() else None


def _offline_table(r: dict, single: bool, read_gbps: float | None = None) -> list[str]:
    """single: one stream, with each system's load time and its decode against the bandwidth roofline
    (roofline.py) at `read_gbps`."""
    if single:
        rows = [
            "| system | decode tok/s | TTFT ms | output tok/s (incl. prefill) | ours / it | load s "
            "| MB read / token | roofline tok/s | % of roofline |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        rows = [
            "| system | output tok/s | total tok/s | requests/s | elapsed s | ours / it |",
            "|---|---|---|---|---|---|",
        ]
    for name, v in r.items():
        if not isinstance(v, dict):
            continue
        label = SYSTEMS.get(name, name)
        ratio = (
            "1.00 (baseline of the ratios)" if name == "pagedllm" else f"{r.get(f'ratio_vs_{name}', 0):.2f}x"
        )
        if single:
            decode = v.get("decode_tokens_per_second")
            ttft = v.get("median_ttft_s")
            d = f"{decode:.1f}" if decode else "n/a"
            t = f"{ttft * 1000:.0f}" if ttft else "n/a"
            rows.append(
                f"| {label} | {d} | {t} | {v['output_tokens_per_second']:.1f} | {ratio} | "
                + " | ".join(_roofline_cells(v, read_gbps))
                + " |"
            )
        else:
            rows.append(
                f"| {label} | {v['output_tokens_per_second']:.1f} | {v['tokens_per_second']:.1f} | "
                f"{v['requests_per_second']:.2f} | {v['elapsed_time']:.1f} | {ratio} |"
            )
    return rows


def _roofline_cells(v: dict, read_gbps: float | None) -> list[str]:
    """load s, MB read / token, roofline tok/s, % of roofline; n/a where the run did not record them."""
    load, mb = v.get("load_time_s"), v.get("bytes_per_token")
    fig = roofline_figures(v, read_gbps)
    return [
        f"{load:.1f}" if load is not None else "n/a",
        f"{mb / 1e6:.1f}" if mb else "n/a",
        f"{fig['roofline_tokens_per_second']:.1f}" if fig else "n/a",
        f"{fig['percent_of_roofline']:.0f}%" if fig else "n/a",
    ]


def _roofline_note(read_gbps: float | None, threads: int | None) -> list[str]:
    if not read_gbps:
        return []
    on = f" on {threads} threads" if threads else ""
    return [
        f"Roofline: a single-stream decode reads every weight once per token, so it can go no faster than the "
        f"read bandwidth ({read_gbps:.1f} GB/s{on}, measured in this run) over the bytes read per token (the "
        "weights as each system stores them, lm_head and norms included, the token embedding excluded); "
        "% of roofline = decode tok/s / roofline tok/s. Load s: start to ready (our model build, "
        "llama-server from its start until /health answers ok).",
        "",
    ]


def _serve_table(runs: list[dict]) -> list[str]:
    rows = [
        "| max concurrency | req/s | output tok/s | TTFT median / p99 ms | TPOT median / p99 ms | "
        "ITL median / p99 ms | E2EL median ms | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows.append(
            f"| {r['max_concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | "
            f"{r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | {r['median_e2el_ms']:.0f} | {r['failed']} |"
        )
    return rows


def _memory_table(m: dict) -> list[str]:
    p = m["shared_prefix"]
    return [
        "| | measured (KVCacheManager) | planner | |",
        "|---|---|---|---|",
        f"| requests that fit, paged | {m['paged_fits']} | {m['planner_paged_fits']} | "
        f"{'agree' if m['paged_fits'] == m['planner_paged_fits'] else 'DIFFER'} |",
        f"| requests that fit, max_model_len reserved | {m['naive_fits']} | {m['planner_naive_fits']} | "
        f"{'agree' if m['naive_fits'] == m['planner_naive_fits'] else 'DIFFER'} |",
        f"| blocks, {p['num_requests']} requests sharing a {p['prefix_len']}-token prompt, no prefix caching | "
        f"{p['blocks_without_prefix_caching']} | {p['planner_blocks_without']} | "
        f"{'agree' if p['blocks_without_prefix_caching'] == p['planner_blocks_without'] else 'DIFFER'} |",
        f"| same, prefix caching | {p['blocks_with_prefix_caching']} | {p['planner_blocks_with']} | "
        f"{'agree' if p['blocks_with_prefix_caching'] == p['planner_blocks_with'] else 'DIFFER'} |",
    ]


def _peer_notes(r: dict) -> list[str]:
    """Say which of the peers a reader would pick is missing from a run, and how to add it."""
    notes = []
    if "llama.cpp" not in r:
        notes.append(
            "llama.cpp is not in this run: no llama-server binary was found. `bash scripts/build_llama_server.sh`"
            " builds it once (cmake, about 25 minutes on 2 cores); then `make bench` puts it in the table."
        )
    if "openvino" not in r:
        notes.append(
            "OpenVINO GenAI is not in this run: `pip install openvino-genai` (or `pip install "
            "'pagedllm[bench]'`), then `make bench` puts it in the table."
        )
    return [*notes, ""] if notes else []


def render(d: Path) -> str:
    m = _load(d, "machine.json") or machine_info(probe_memory=False)
    end = _load(d, "machine_end.json") or {}
    commands = (d / "commands.txt").read_text().strip() if (d / "commands.txt").is_file() else ""
    v = m["versions"]
    out = [
        "# Benchmarks",
        "",
        "<!-- generated by `make bench` (scripts/bench_all.sh -> python -m pagedllm.bench.report); edit the generator -->",
        "",
        "`pagedllm bench` measures the engine the way vLLM's `vllm bench` does, and runs the tools people use",
        "today on the same prompts in the same run, so that the ratios stay meaningful on a noisy machine:",
        "",
        "- `pagedllm bench throughput`: offline, every prompt submitted at once (`vllm bench throughput`);",
        "  `--compare hf` runs HF transformers `generate` on a left-padded static batch in the same dtype as ours,",
        "  `--compare llama.cpp` starts llama.cpp's own `llama-server` on the same GGUF (2 threads, one slot per",
        "  prompt, continuous batching) and sends every prompt at once as token ids to its `/completion` endpoint;",
        "  `--compare openvino` runs OpenVINO GenAI's `ContinuousBatchingPipeline` on the same GGUF (2 threads),",
        "  every prompt in one `generate`. Both are optional: `scripts/build_llama_server.sh` builds llama-server,",
        "  `pip install openvino-genai` adds OpenVINO. (`--compare llama-cpp-python` is the Python binding in process.)",
        "- `pagedllm bench serve`: online, against any OpenAI-compatible server (`vllm bench serve`): Poisson",
        "  arrivals (`--request-rate`), `--max-concurrency` (several values = a sweep), streamed requests;",
        "  TTFT, TPOT = (E2EL - TTFT) / (output tokens - 1), ITL, E2EL; `--launch` starts `pagedllm serve` itself.",
        "- `pagedllm bench memory`: how many requests a KV budget holds, paged vs a max_model_len reservation,",
        "  and what a shared prefix saves, measured through the engine's real KVCacheManager (requests are",
        "  allocated with `allocate_slots`, the scheduler's calls, without running the model) beside the",
        "  planner's formula.",
        "",
        "Every command takes `--output-json` (vLLM's key names) and `--plot-dir`.",
        "",
        "## This run",
        "",
        f"- date: {m['date']}; 1-minute load average {m['loadavg_1m']:.1f} at the start and"
        f" {end.get('loadavg_1m', float('nan')):.1f} at the end (the benchmark itself adds about 1 on 2 cores;"
        " more means other work shared the machine): compare the ratios, measured in the same run.",
        *_memory_speed_line(m, end),
        f"- CPU: {m['cpu']}, {m['cores']} cores; flags: {', '.join(m['flags']) or 'none of note'}",
        f"- torch threads (OMP_NUM_THREADS, ours and HF alike): {m.get('omp_num_threads') or 'default'}."
        " On a machine shared with other busy processes one thread is several times faster than two"
        " (two threads spin and wait for each other when a core is taken away).",
        f"- Python {m['python']}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"openvino-genai {v.get('openvino_genai') or 'not installed (OpenVINO rows skipped)'}, "
        f"llama-server {m.get('llama_server') or 'not built (llama.cpp rows skipped)'}",
        "- model: the default, SmolLM2-135M-Instruct (Q4_1 GGUF; we and HF dequantize it to bf16, llama.cpp runs Q4_1, OpenVINO its own reading of it)",
        "- the engine is being optimized at the same time: these figures are one honest run of the tooling.",
        "- scale of the noise: shared/bench/README.md measured HF bf16 on a quiet machine of this kind at 275",
        "  output tok/s on W32 and 40-48 decode tok/s on single50; compare with the HF rows below to see how",
        "  much of the machine this run had.",
        "",
        "Regenerate everything (tables, plots, this file):",
        "",
        "```bash",
        "make bench        # = bash scripts/bench_all.sh",
        "```",
        "",
    ]
    w32 = _load(d, "w32.json")
    if w32:
        out += [
            "## W32: offline throughput",
            "",
            "32 plain prompts (4,942 prompt tokens), 128 greedy tokens each with ignore_eos (4,096 output tokens);",
            "medians of the runs. ours / it = our output tok/s over theirs.",
            "",
            *_offline_table(w32, single=False),
            "",
            *_peer_notes(w32),
            "![W32 offline throughput](img/offline_w32.png)",
            "",
        ]
    s50 = _load(d, "single50.json")
    if s50:
        out += [
            "## single50: one stream",
            "",
            "One 50-token prompt, 128 tokens: decode tok/s after the first token, and time to first token.",
            "ours / it compares output tok/s including the prefill.",
            "",
            *_roofline_note(*_read_bandwidth(s50, m)),
            *_offline_table(s50, single=True, read_gbps=_read_bandwidth(s50, m)[0]),
            "",
        ]
    gguf = [
        (_load(d, f"{name}_gguf.json"), name, single) for name, single in (("w32", False), ("single50", True))
    ]
    if any(r for r, _, _ in gguf):
        out += [
            "## The same, with the GGUF weights served natively",
            "",
            "`--quantization gguf`: the default model's Q4_1 linears and Q8_0 lm_head multiplied from their own",
            "blocks (a C++ kernel for 1-8 rows, the AMX kernel above, where the CPU has AMX), HF bf16",
            "again in the same run.",
            "",
        ]
        for r, name, single in gguf:
            if r:
                gbps = _read_bandwidth(r, m)[0] if single else None
                out += [f"{name}:", "", *_offline_table(r, single=single, read_gbps=gbps), ""]
    serve = _load(d, "serve.json")
    if serve:
        runs = serve.get("runs", [serve])
        r0 = runs[0]
        out += [
            "## Serving: latency against concurrency",
            "",
            f"`pagedllm bench serve --launch`: {r0['completed'] + r0['failed']} requests of "
            f"{r0['total_input_tokens'] // max(1, r0['completed'])} prompt tokens, "
            f"{r0['total_output_tokens'] // max(1, r0['completed'])} output tokens each, all arriving at once, "
            "at each max concurrency in turn, to /v1/completions with streaming.",
            "",
            *_serve_table(runs),
            "",
            "![throughput vs concurrency](img/serve_concurrency.png)",
            "",
            "![TTFT and ITL](img/serve_latency.png)",
            "",
        ]
    mem = _load(d, "memory.json")
    if mem:
        mix = mem["length_mix"]
        out += [
            "## Memory: paged blocks vs max-length reservation",
            "",
            f"KV cache of {mem['num_blocks']} blocks x {mem['block_size']} tokens "
            f"({mem['kv_cache_bytes'] / 2**20:.0f} MiB, {mem['kv_cache_dtype']}, {mem['kv_bytes_per_token']} bytes a token), "
            f"max_model_len {mem['max_model_len']}. Length mix: {mix['num_requests']} requests, prompt + output "
            f"uniform in [{mix['min_len']}, {mix['max_len']}] tokens (seed {mix['seed']}), admitted in order until "
            "one does not fit; each counted at its full length.",
            "",
            *_memory_table(mem),
            "",
            f"Paged holds {mem['paged_over_naive']:.1f}x the requests; its waste is {mem['paged_waste_tokens']} slots "
            f"over {mem['paged_fits']} requests (under one block each), against "
            f"{mem['naive_waste_tokens_at_naive_fits']} slots over {mem['naive_fits']} with the reservation. "
            f"A shared prefix saves {mem['shared_prefix']['blocks_saved']} blocks. Planner agreement: "
            f"{'yes, every figure' if mem['planner_agrees'] else 'NO'}.",
            "",
            "![memory](img/memory.png)",
            "",
        ]
    if commands:
        out += ["## Commands of this run", "", "```bash", commands, "```", ""]
    return "\n".join(out)


def replot(d: Path, img: Path) -> None:
    """Draw the doc's plots again from the JSON reports, so the doc and its images always match."""
    from pagedllm.bench import plots

    if w32 := _load(d, "w32.json"):
        # bench_all.sh runs W32 dequantized (--quantization none), then with the GGUF served natively
        more = {"gguf": _load(d, "w32_gguf.json")}
        plots.plot_offline(
            w32, img / "offline_w32.png", "W32: output tokens/s", quantization="none", more_runs=more
        )
    if serve := _load(d, "serve.json"):
        runs = serve.get("runs", [serve])
        plots.plot_latency(runs, img / "serve_latency.png")
        if len(runs) > 1:
            plots.plot_concurrency(runs, img / "serve_concurrency.png")
    if mem := _load(d, "memory.json"):
        plots.plot_memory(mem, img / "memory.png")


def main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "machine":  # machine FILE [THREADS]: the probe's thread count
        threads = int(argv[2]) if len(argv) == 3 else None
        Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[1]).write_text(json.dumps(machine_info(threads=threads), indent=2))
        return 0
    if len(argv) == 3 and argv[0] == "render":
        replot(Path(argv[1]), Path(argv[2]).parent / "img")
        Path(argv[2]).write_text(render(Path(argv[1])))
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
