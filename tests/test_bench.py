"""Smoke tests of `pagedllm bench throughput | serve | memory`: tiny sizes, report fields and sanity.

Never timing: only counts, positivity and order (median <= p99), and memory arithmetic that must agree
exactly with the planner.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from pagedllm.bench import serve as bench_serve
from pagedllm.bench.dataset import BenchPrompt, load_dataset
from pagedllm.bench.memory import count_fits, length_mix, planner_fits, shared_prefix_blocks
from pagedllm.config import CacheConfig
from pagedllm.entrypoints.cli.main import main

SERVE_KEYS = [
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
]


def _check_serve(r: dict, n: int, out_len: int, chunk_per_token: bool = True) -> None:
    for key in SERVE_KEYS:
        assert key in r, key
    assert r["completed"] == n and r["failed"] == 0, r["errors"]
    assert r["total_output_tokens"] == n * out_len
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert r["total_token_throughput"] >= r["output_throughput"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 <= r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"]
    assert r["median_ttft_ms"] <= r["p99_e2el_ms"]
    # completions send a chunk a token; chat skips a token whose text the detokenizer holds back
    assert all(len(row) == out_len - 1 if chunk_per_token else len(row) < out_len for row in r["itls"])


# ---- pure parts: no model ---------------------------------------------------------------------------
def test_dataset_formats(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi", "max_tokens": 3}\n{"prompt": "yo"}\n')
    (tmp_path / "b.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"}]}]))
    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    assert [(p.prompt, p.max_tokens) for p in load_dataset(tmp_path / "a.jsonl", 7)] == [("hi", 3), ("yo", 7)]
    assert [p.prompt for p in load_dataset(tmp_path / "b.json")] == ["q"]
    assert [p.prompt for p in load_dataset(tmp_path / "c.txt", num_prompts=1)] == ["one"]


def test_percentile_and_summary() -> None:
    assert bench_serve.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert bench_serve.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    rs = [
        bench_serve.RequestResult(True, 5, 4, 0.1, [0.02, 0.03, 0.04], 0.19),
        bench_serve.RequestResult(True, 5, 4, 0.2, [0.02, 0.02, 0.02], 0.26),
        bench_serve.RequestResult(False, 5, 0, error="HTTP 500"),
    ]
    r = bench_serve.summarize(rs, 1.0)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (2, 1, 8)
    assert r["mean_tpot_ms"] == pytest.approx(((0.09 / 3) + (0.06 / 3)) / 2 * 1000)
    assert r["median_itl_ms"] == pytest.approx(20.0)


def test_memory_accounting_agrees_with_planner() -> None:
    cache = CacheConfig(block_size=16, num_blocks=512)
    mix = length_mix(64, 50, 2000, seed=1)
    paged, blocks = count_fits(cache, mix, None)
    naive, naive_blocks = count_fits(cache, mix, 2048)
    assert paged == planner_fits(mix.totals, 512, 16) and paged >= naive
    assert naive == 512 * 16 // 2048 and naive_blocks == naive * 2048 // 16
    assert blocks <= 512
    p = shared_prefix_blocks(cache, 8, 200, 50, 100)
    assert p["blocks_saved"] > 0
    assert p["blocks_with_prefix_caching"] == p["planner_blocks_with"]
    assert p["blocks_without_prefix_caching"] == p["planner_blocks_without"]


# ---- bench serve against the in-process fake server (fast) -------------------------------------------
@pytest.fixture(scope="module")
def fake_server():
    from fake_engine import FakeEngine, serve_in_thread

    from pagedllm.engine.async_engine import AsyncEngine

    engine = AsyncEngine(FakeEngine(max_model_len=2048, num_kv_blocks=4096, max_num_seqs=8))
    with serve_in_thread(engine) as (base_url, _):
        yield base_url


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_fake(fake_server: str, endpoint: str) -> None:
    prompts = [BenchPrompt("a short prompt", 6) for _ in range(6)]
    r = asyncio.run(
        bench_serve.run_serve(
            fake_server, endpoint, "fake", prompts, request_rate=50.0, max_concurrency=3, use_tqdm=False
        )
    )
    _check_serve(r, 6, 6, chunk_per_token=endpoint == "/v1/completions")
    assert r["max_concurrency"] == 3


def test_bench_serve_reports_failures(fake_server: str) -> None:
    prompts = [BenchPrompt([5, 6], 4)] * 2
    with pytest.raises(ConnectionError):  # the warm-up request already fails: wrong model name
        asyncio.run(bench_serve.run_serve(fake_server, "/v1/completions", "nope", prompts, use_tqdm=False))


def test_sse_parse_with_mock_transport() -> None:
    chunks = [{"choices": [{"text": t}]} for t in ("a", "", "b")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def go() -> bench_serve.RequestResult:
        transport = httpx.MockTransport(lambda req: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench_serve.send_request(client, "http://x/v1/completions", {}, {}, 0)

    r = asyncio.run(go())
    assert r.success and r.output_tokens == 3 and r.prompt_len == 9 and len(r.itl) == 2
    assert 0 <= r.ttft <= r.latency


# ---- the CLI with the real default model -------------------------------------------------------------
@pytest.mark.slow
def test_cli_throughput(tmp_path: Path, capsys) -> None:
    """vLLM's keys and sane counts; OpenVINO compared when installed, else a skip line naming the install;
    llama.cpp pointed at a missing llama-server: a skip line naming it and the build script."""
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
    argv += [
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--compare",
        "llama.cpp",
        "--compare",
        "openvino",
    ]
    argv += ["--llama-server", str(tmp_path / "no-llama-server")]
    argv += ["--output-json", str(out), "--plot-dir", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    r = report["pagedllm"]
    for key in (
        "elapsed_time",
        "num_requests",
        "total_num_tokens",
        "requests_per_second",
        "tokens_per_second",
    ):
        assert report[key] == r[key]  # vLLM's flat keys at the top
    assert r["num_requests"] == 2 and r["output_tokens"] == 8 and r["total_num_tokens"] == 24
    assert r["tokens_per_second"] > r["output_tokens_per_second"] > 0
    # the default model's decode reads tens of MB a token (135M weights, 4 to 32 bits each, lm_head included)
    assert 20e6 < r["bytes_per_token"] < 600e6
    assert (tmp_path / "offline_random.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "output tokens/s" in printed
    assert "llama.cpp" not in report
    assert f"llama.cpp: skipped: llama-server not found at {tmp_path / 'no-llama-server'}" in printed
    assert "scripts/build_llama_server.sh" in printed
    if "openvino" in report:
        assert report["ratio_vs_openvino"] > 0 and report["openvino"]["output_tokens"] == 8
    else:
        assert "openvino: skipped: openvino-genai is not installed" in printed


@pytest.mark.slow
def test_cli_serve_launch(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["bench", "serve", "--launch", "--num-prompts", "4", "--input-len", "8", "--output-len", "4"]
    argv += ["--max-concurrency", "2", "--num-kv-blocks", "64", "--max-model-len", "256"]
    argv += ["--output-json", str(out), "--plot-dir", str(tmp_path)]
    assert main(argv) == 0
    _check_serve(json.loads(out.read_text()), 4, 4)
    assert (tmp_path / "serve_latency.png").stat().st_size > 0


@pytest.mark.slow
def test_cli_memory(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    argv = ["bench", "memory", "--num-kv-blocks", "256", "--max-model-len", "1024", "--num-requests", "32"]
    argv += ["--min-len", "50", "--max-len", "800", "--prefix-requests", "8", "--output-json", str(out)]
    argv += ["--plot-dir", str(tmp_path)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["num_blocks"] == 256 and r["max_model_len"] == 1024
    assert r["paged_fits"] >= r["naive_fits"] == 4
    assert r["shared_prefix"]["blocks_saved"] > 0
    assert r["planner_agrees"] is True
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_cli_errors(capsys) -> None:
    assert main(["bench", "serve", "--request-rate", "0"]) == 2
    assert main(["bench", "throughput", "--dataset", "/nonexistent.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_repeat_reports_one_whole_median_run():
    """Time and rates of the reported figure come from the same run, so they agree with each other."""
    from pagedllm.bench.throughput import summarize
    from pagedllm.entrypoints.cli.bench import _median

    runs = [
        summarize(
            {
                "elapsed_time": t,
                "num_requests": 32,
                "prompt_tokens": 8192,
                "output_tokens": 32,
                "median_ttft_s": t / 2,
                "decode_tokens_per_second": 0.0,
            }
        )
        for t in (0.5, 2.0, 1.0, 4.0)
    ]
    got = _median(runs)
    assert got["elapsed_time"] == 2.0  # of the two middle runs (1.0, 2.0), the slower
    assert got["tokens_per_second"] == 8224 / 2.0 and got["median_ttft_s"] == 1.0


def test_report_renders_the_gguf_native_runs(tmp_path):
    """make bench's report: the --quantization gguf runs get their own tables, with HF from their run."""
    from pagedllm.bench import report

    def run(out_tps: float) -> dict:
        return {
            "output_tokens_per_second": out_tps,
            "tokens_per_second": 2 * out_tps,
            "requests_per_second": 1.0,
            "elapsed_time": 10.0,
            "decode_tokens_per_second": out_tps,
            "median_ttft_s": 0.05,
        }

    (tmp_path / "w32_gguf.json").write_text(
        json.dumps({"pagedllm": run(400.0), "hf": run(200.0), "ratio_vs_hf": 2.0})
    )
    text = report.render(tmp_path)
    assert "## The same, with the GGUF weights served natively" in text
    assert "| 400.0 | 800.0 | 1.00 | 10.0 |" in text and "2.00x" in text
    assert "single50:" not in text  # only what ran is shown


def test_report_states_the_memory_read_speed_at_both_ends(tmp_path):
    """The machine's speed of the moment, measured (a shared VM's swings move every absolute figure)."""
    from pagedllm.bench import report

    now = report.machine_info(threads=1)
    assert 0.1 < now["memory_read_gbps"] < 10_000 and now["memory_read_threads"] == 1
    (tmp_path / "machine.json").write_text(
        json.dumps(now | {"memory_read_gbps": 16.7, "memory_read_threads": 2})
    )
    (tmp_path / "machine_end.json").write_text(json.dumps(now | {"memory_read_gbps": 19.4}))
    text = report.render(tmp_path)
    assert (
        "memory read speed (`torch.sum` over 512 MB on 2 threads, the benchmarks' own count): 16.7 GB/s at the"
        " start and 19.4 at the end" in text
    )
    assert "memory read speed" not in report.render(tmp_path / "empty")  # no machine.json: no probe, no line


def test_memory_probe_runs_on_the_threads_asked_and_gives_torch_its_own_back(monkeypatch):
    """The roofline's bandwidth must be read on the benchmark's threads (one core cannot fill the bus)."""
    import torch

    from pagedllm.bench import report

    calls = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or set_threads(n))
    before = torch.get_num_threads()
    assert report.memory_read_gbps(megabytes=64, repeats=1, threads=1) > 0
    assert calls == [1, before] and torch.get_num_threads() == before
    calls.clear()
    # default: torch's own count (--threads, else OMP_NUM_THREADS)
    report.memory_read_gbps(megabytes=64, repeats=1)
    assert calls == [before, before]


def test_report_puts_load_time_and_the_roofline_beside_the_single_stream_decode(tmp_path):
    """single50: each system's load time, MB read per token, roofline tok/s (bandwidth / bytes) and the % of
    it its decode reaches; the run's own bandwidth when it measured one, else the machine probe's."""
    from pagedllm.bench import report

    def row(decode: float, mb: float | None, load: float | None) -> dict:
        r = {"output_tokens_per_second": decode, "decode_tokens_per_second": decode, "median_ttft_s": 0.05}
        if mb:
            r["bytes_per_token"] = int(mb * 1e6)
        if load:
            r["load_time_s"] = load
        return r

    s50 = {
        "pagedllm": row(50.0, 200.0, 2.5),
        "llama.cpp": row(40.0, 100.0, 0.8),
        "hf": row(20.0, None, None),
    }
    s50 |= {"ratio_vs_llama.cpp": 1.25, "ratio_vs_hf": 2.5}
    (tmp_path / "single50.json").write_text(json.dumps(s50))
    machine = report.machine_info(probe_memory=False) | {"memory_read_gbps": 20.0, "memory_read_threads": 2}
    (tmp_path / "machine.json").write_text(json.dumps(machine))
    text = report.render(tmp_path)
    assert "| load s | MB read / token | roofline tok/s | % of roofline |" in text
    assert "| 1.00 (baseline of the ratios) | 2.5 | 200.0 | 100.0 | 50% |" in text  # 20 GB/s / 200 MB
    assert "| 1.25x | 0.8 | 100.0 | 200.0 | 20% |" in text  # 20 GB/s / 100 MB = 200 tok/s; 40 of it
    assert "| 2.50x | n/a | n/a | n/a | n/a |" in text  # recorded nothing: says so
    assert "read bandwidth (20.0 GB/s on 2 threads, measured in this run)" in text
    (tmp_path / "single50.json").write_text(json.dumps(s50 | {"memory_read_gbps": 10.0}))
    assert "| 2.5 | 200.0 | 50.0 | 100% |" in report.render(tmp_path)  # the run's own bandwidth first


# ---- the peers: llama.cpp's llama-server and OpenVINO GenAI, without either installed -------------------
def test_compare_choices_parse(capsys) -> None:
    from pagedllm.entrypoints.cli.main import build_parser

    argv = ["bench", "throughput", "--compare", "llama.cpp", "--compare", "openvino"]
    args = build_parser().parse_args([*argv, "--compare", "hf", "--llama-server", "/opt/llama-server"])
    assert args.compare == ["llama.cpp", "openvino", "hf"] and args.llama_server == "/opt/llama-server"
    assert build_parser().parse_args(["bench", "throughput", "--compare", "llama-cpp-python"]).compare
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--compare", "vllm"])
    assert "invalid choice" in capsys.readouterr().err


def test_llama_server_unavailable_names_the_binary_and_the_script(tmp_path: Path, monkeypatch) -> None:
    from pagedllm.bench import llamacpp_server

    missing = tmp_path / "nowhere" / "llama-server"
    reason = llamacpp_server.unavailable_reason(missing, tmp_path / "m.gguf")
    assert str(missing) in reason and "scripts/build_llama_server.sh" in reason
    # where it is looked for: --llama-server, else $PAGEDLLM_LLAMA_SERVER, else the build script's cache
    monkeypatch.setenv("PAGEDLLM_LLAMA_SERVER", "/env/llama-server")
    assert llamacpp_server.binary_path("/flag/llama-server") == Path("/flag/llama-server")
    assert llamacpp_server.binary_path() == Path("/env/llama-server")
    monkeypatch.delenv("PAGEDLLM_LLAMA_SERVER")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert llamacpp_server.binary_path() == tmp_path / "pagedllm/llama.cpp/0.3.36/bin/llama-server"
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert "not one" in llamacpp_server.unavailable_reason(binary, tmp_path / "model.safetensors")
    assert llamacpp_server.unavailable_reason(binary, tmp_path / "m.gguf") is None


def test_openvino_unavailable_names_the_package(monkeypatch, tmp_path: Path) -> None:
    import sys

    from pagedllm.bench import openvino

    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # import fails, installed or not
    reason = openvino.unavailable_reason(tmp_path / "m.gguf")
    assert "openvino-genai is not installed" in reason and "pip install openvino-genai" in reason


def test_llama_server_command_and_request_body() -> None:
    from pagedllm.bench import llamacpp_server as ls

    ids = [[1, 2, 3], list(range(290))]
    assert ls.context_per_slot(ids, [128, 128]) == 512  # 290 + 128 + 16, rounded up to 256
    cmd = ls.server_command(Path("/b/llama-server"), Path("/m.gguf"), 4321, 32, 512, 2)
    flags = {f: cmd[cmd.index(f) + 1] for f in ("-m", "--host", "--port", "-t", "-np", "-c")}
    assert flags["-m"] == "/m.gguf" and flags["--host"] == "127.0.0.1" and flags["--port"] == "4321"
    assert flags["-t"] == "2" and flags["-np"] == "32" and flags["-c"] == str(32 * 512)
    assert "-cb" in cmd and "--no-warmup" in cmd
    assert ls.request_body([5, 6, 7], 128) == {
        "prompt": [5, 6, 7],
        "n_predict": 128,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
    }


def _recorded_stream(n: int, evaluated: int, t0: float = 10.0) -> list[tuple[float, str]]:
    """A llama-server /completion stream as it arrives: a chunk without a token, one a token, the final."""
    chunks = [(t0 + 0.01, {"content": "", "tokens": [], "stop": False})]
    chunks += [(t0 + 0.5 + 0.1 * i, {"content": "a", "tokens": [100 + i], "stop": False}) for i in range(n)]
    final = {"tokens": [], "stop": True, "tokens_predicted": n, "tokens_evaluated": evaluated}
    chunks.append((t0 + 0.5 + 0.1 * (n - 1), final | {"stop_type": "limit"}))
    lines = []
    for at, c in chunks:
        lines += [(at, f"data: {json.dumps(c)}"), (at, "")]
    return lines


def test_llama_server_reply_parsing_counts_and_timings() -> None:
    from pagedllm.bench import llamacpp_server as ls

    r = ls.parse_stream(_recorded_stream(5, evaluated=3))
    assert r.tokens == [100, 101, 102, 103, 104] and r.tokens_predicted == 5 and r.stop_type == "limit"
    ls.check_reply(r, prompt_len=3, n_predict=5)
    run = ls.summarize_replies([r], sent_at=10.0, finished_at=10.9, prompt_tokens=3)
    assert run["output_tokens"] == 5 and run["num_requests"] == 1
    assert run["median_ttft_s"] == pytest.approx(0.5)  # the first chunk carrying a token, not the empty one
    assert run["decode_tokens_per_second"] == pytest.approx(4 / 0.4)  # tokens after the first, time after it
    assert run["elapsed_time"] == pytest.approx(0.9)
    with pytest.raises(RuntimeError, match="5 tokens streamed, 5 reported, 6 asked"):
        ls.check_reply(r, prompt_len=3, n_predict=6)
    with pytest.raises(RuntimeError, match="3 prompt tokens evaluated, 4 sent"):
        ls.check_reply(r, prompt_len=4, n_predict=5)
    with pytest.raises(RuntimeError, match="no final chunk"):
        ls.check_reply(ls.parse_stream(_recorded_stream(5, 3)[:-2]), prompt_len=3, n_predict=5)
    with pytest.raises(RuntimeError, match="slot unavailable"):
        ls.parse_stream([(0.0, 'data: {"error": {"message": "slot unavailable"}}')])


def test_llama_server_withheld_tokens_count_as_generated() -> None:
    """llama-server streams no chunk for a token whose text ends in an incomplete UTF-8 sequence; each chunk's
    running tokens_predicted shows it, so the reply still checks and counts every generated token, and a
    chunk lost without that evidence still fails."""
    from pagedllm.bench import llamacpp_server as ls

    lines = []
    for i in (1, 2, 4, 5):  # token 3 was generated, never streamed
        c = {"content": "a", "tokens": [100 + i], "stop": False, "tokens_predicted": i}
        lines.append((10.0 + 0.1 * i, f"data: {json.dumps(c)}"))
    final = {"tokens": [], "stop": True, "tokens_predicted": 5, "tokens_evaluated": 3, "stop_type": "limit"}
    lines.append((10.6, f"data: {json.dumps(final)}"))
    r = ls.parse_stream(lines)
    assert len(r.tokens) == 4 and r.withheld == 1
    ls.check_reply(r, prompt_len=3, n_predict=5)
    assert ls.summarize_replies([r], 10.0, 10.6, 3)["output_tokens"] == 5
    without_counts = [(at, line.replace(', "tokens_predicted": 4', "")) for at, line in lines[:-2]] + lines[
        -1:
    ]
    with pytest.raises(RuntimeError, match="3 tokens streamed, 5 reported"):
        ls.check_reply(ls.parse_stream(without_counts), prompt_len=3, n_predict=5)
    # a reply that ends in an incomplete UTF-8 sequence: its last tokens never streamed, the final count
    # shows them (seen with llama-server 0.3.36 on a random-weight 1B: 125 streamed + 2 withheld, 128)
    for tail in (1, 3):
        final = {"tokens": [], "stop": True, "tokens_predicted": 5 + tail, "tokens_evaluated": 3}
        ends_short = [*lines[:-1], (10.9, f"data: {json.dumps(final)}")]
        r = ls.parse_stream(ends_short)
        assert (len(r.tokens), r.withheld) == (4, 1 + tail)
        ls.check_reply(r, prompt_len=3, n_predict=5 + tail)
    # more than a UTF-8 sequence's bytes missing at the end, or after a stream without running counts: lost
    final = {"tokens": [], "stop": True, "tokens_predicted": 9, "tokens_evaluated": 3}
    with pytest.raises(RuntimeError, match=r"4 tokens streamed \(\+1 withheld\), 9 reported"):
        ls.check_reply(ls.parse_stream([*lines[:-1], (10.9, f"data: {json.dumps(final)}")]), 3, 9)
    final = {"tokens": [], "stop": True, "tokens_predicted": 6, "tokens_evaluated": 3}
    with pytest.raises(RuntimeError, match="3 tokens streamed, 6 reported"):
        ls.check_reply(ls.parse_stream([*without_counts[:-1], (10.9, f"data: {json.dumps(final)}")]), 3, 6)


def test_llama_server_run_against_a_fake_server(tmp_path: Path) -> None:
    """Start, /health (503 then 200), all prompts at once as token ids, counts checked, server stopped."""
    import os
    import sys

    from test_roofline import write_tiny_gguf

    from pagedllm.bench import llamacpp_server as ls

    binary = tmp_path / "llama-server"
    fake = Path(__file__).with_name("fake_llama_server.py")
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" "$@"\n')
    binary.chmod(0o755)
    log = tmp_path / "requests.jsonl"
    os.environ["FAKE_LLAMA_LOG"] = str(log)
    try:
        prompts = [BenchPrompt([7, 8, 9], 4), BenchPrompt([1, 2], 6), BenchPrompt([3], 5)]
        model = write_tiny_gguf(tmp_path / "m.gguf")  # the fake server never reads it; the byte count does
        runs = ls.run_llama_server(binary, model, prompts, threads=2, repeat=2)
    finally:
        del os.environ["FAKE_LLAMA_LOG"]
    assert len(runs) == 2
    for run in runs:
        assert run["num_requests"] == 3 and run["output_tokens"] == 15 and run["prompt_tokens"] == 6
        # start to /health ok: the fake answers 503 to the first poll, and the poll waits 0.2 s before the next
        assert run["load_time_s"] >= 0.2 and run["bytes_per_token"] == 3520  # test_roofline's hand count
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert records[0]["slots"] == 3  # one slot per prompt
    bodies = [r["body"] for r in records if "body" in r]
    assert bodies[0] == ls.request_body([7, 8, 9], 2)  # the warm-up, not timed
    assert sorted((b["prompt"], b["n_predict"]) for b in bodies[1:4]) == [
        ([1, 2], 6),
        ([3], 5),
        ([7, 8, 9], 4),
    ]
    with pytest.raises(ProcessLookupError):  # stopped at the end
        os.kill(records[0]["pid"], 0)


def test_report_names_the_peers_and_says_how_to_add_a_missing_one(tmp_path):
    from pagedllm.bench import report

    row = {"output_tokens_per_second": 100.0, "tokens_per_second": 200.0, "requests_per_second": 1.0}
    row |= {"elapsed_time": 40.0}
    w32 = {"pagedllm": row, "openvino": row | {"output_tokens_per_second": 50.0}, "ratio_vs_openvino": 2.0}
    (tmp_path / "w32.json").write_text(json.dumps(w32))
    text = report.render(tmp_path)
    assert "| OpenVINO GenAI `ContinuousBatchingPipeline` reading the Q4_1 GGUF | 50.0 |" in text
    assert (
        "2.00x" in text and "bash scripts/build_llama_server.sh" in text
    )  # llama.cpp missing: how to add it
    assert "OpenVINO GenAI is not in this run" not in text
