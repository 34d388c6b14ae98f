"""llama.cpp as its users serve it: its own `llama-server`, continuous batching over parallel slots.

`--compare llama.cpp`: the server is started as a child process on a free loopback port with one slot per
prompt (`-np N -cb`, each slot a context of the longest prompt + output), 2 threads, on the same GGUF
file; every prompt is sent at once to its native `/completion` endpoint as our tokenizer's token ids,
greedy, exactly max_tokens (`ignore_eos`), no prompt cache, streamed. Measured like our own rows: output
tokens over the wall time of the whole workload; for one prompt, TTFT (first streamed token) and decode
tokens/s after it. The reply's counts are checked against what was asked. Each run also records the
server's load time (process start until /health answers ok) and the file's bytes read per generated token
(roofline.py), for the single-stream roofline.

The binary: scripts/build_llama_server.sh builds it once from the llama.cpp vendored in
llama-cpp-python==0.3.36 into ~/.cache/pagedllm/llama.cpp/0.3.36/bin/ (`PAGEDLLM_LLAMA_SERVER` or
`--llama-server PATH` point at another).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedllm.bench.dataset import BenchPrompt, prompt_token_ids
from pagedllm.bench.launch import free_port
from pagedllm.bench.roofline import gguf_bytes_per_token

LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp the script builds
BUILD_SCRIPT = "scripts/build_llama_server.sh"
MAX_SLOTS = 64  # more prompts than this queue for a free slot, as they would on a real server


def default_binary() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pagedllm" / "llama.cpp" / LLAMA_CPP_VERSION / "bin" / "llama-server"


def binary_path(override: str | None = None) -> Path:
    """--llama-server, else $PAGEDLLM_LLAMA_SERVER, else the build script's cache folder."""
    return Path(override or os.environ.get("PAGEDLLM_LLAMA_SERVER") or default_binary()).expanduser()


def library_env(binary: Path) -> dict[str, str]:
    """The environment to run the binary in: the shared libraries it was linked with (libllama, libggml*)
    lie beside it, where the build script copies them, and its RUNPATH may name the build folder."""
    env = os.environ.copy()
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent), env.get("LD_LIBRARY_PATH")]))
    return env


def unavailable_reason(binary: Path, model_path: Path) -> str | None:
    """Why llama-server cannot run here, or None when it can."""
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return (
            f"llama-server not found at {binary}; build it once with {BUILD_SCRIPT} (about 25 minutes on "
            "2 cores), or give its path with --llama-server / PAGEDLLM_LLAMA_SERVER"
        )
    if model_path.suffix != ".gguf":
        return f"llama-server needs a GGUF file; {model_path} is not one"
    return None


def server_command(binary: Path, model_path: Path, port: int, slots: int, ctx_per_slot: int, threads: int):
    """The command line, as llama-server's README and `--help` of this version name the flags."""
    return [
        str(binary),
        *("-m", str(model_path), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-tb", str(threads)),
        # one slot per prompt, continuous batching; without -kvu each slot gets its own -c / -np context
        *("-np", str(slots), "-cb", "-c", str(ctx_per_slot * slots)),
        "--no-warmup",  # our own warm-up request instead, before the clock starts, like the other peers
        "--no-webui",
    ]


def context_per_slot(ids: list[list[int]], max_tokens: list[int]) -> int:
    """The longest prompt + output, with room to spare, rounded up to 256 (llama.cpp pads to that)."""
    need = max(len(x) + n for x, n in zip(ids, max_tokens)) + 16
    return -(-need // 256) * 256


def request_body(prompt_ids: list[int], n_predict: int) -> dict:
    """One /completion request: the token ids as given, greedy, exactly n_predict tokens, streamed."""
    return {
        "prompt": list(prompt_ids),
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,  # every run cold, like ours (its prefix cache is reset before each run)
        "stream": True,
        "return_tokens": True,
    }


@dataclass
class Reply:
    """What one streamed /completion reply came to; times are time.perf_counter() readings."""

    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens_predicted: int | None = None  # the server's own counts, from its final chunk
    tokens_evaluated: int | None = None
    stop_type: str | None = None
    # tokens generated but never streamed: llama-server sends no chunk for a token whose text ends in an
    # incomplete UTF-8 sequence (common with random-weight models' byte tokens), and the next chunk carries
    # only its own token id; each chunk's running tokens_predicted shows the gap. Where the reply ends in
    # such a sequence its last tokens are never streamed at all (the final chunk carries no tokens): the
    # final count shows that gap, taken only after a stream whose running counts were whole (TAIL_WITHHELD)
    withheld: int = 0
    counts_whole: bool = False  # the last chunk with a token carried a running count that matched


# the most tokens an incomplete UTF-8 sequence can hold back at the end: its 1-3 bytes, a byte token each
TAIL_WITHHELD = 3


def parse_stream(lines: Iterable[tuple[float, str]]) -> Reply:
    """Server-sent events `data: {...}` with the time each line arrived: one chunk a generated token
    (`tokens: [id]`), a first chunk with no token, and a final one (`stop: true`) with the counts."""
    r = Reply()
    for at, line in lines:
        if not line.startswith("data: "):
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise RuntimeError(f"llama-server: {chunk['error']}")
        if chunk.get("tokens"):
            if r.first_token_at is None:
                r.first_token_at = at
            counted = chunk.get("tokens_predicted")
            if counted is not None and not chunk.get("stop"):
                r.withheld = counted - len(r.tokens) - len(chunk["tokens"])
            r.counts_whole = counted is not None and r.withheld >= 0
            r.tokens += chunk["tokens"]
        if chunk.get("stop"):
            r.finished_at = at
            r.tokens_predicted = chunk.get("tokens_predicted")
            tail = (r.tokens_predicted or 0) - len(r.tokens) - r.withheld
            if r.counts_whole and 0 < tail <= TAIL_WITHHELD:
                r.withheld += tail
            r.tokens_evaluated = chunk.get("tokens_evaluated")
            r.stop_type = chunk.get("stop_type")
    return r


def check_reply(r: Reply, prompt_len: int, n_predict: int) -> None:
    """The figures are only worth something if the server did the very work asked of it."""
    problems = []
    if r.finished_at is None:
        problems.append("no final chunk")
    if len(r.tokens) + r.withheld != n_predict or r.tokens_predicted != n_predict:
        withheld = f" (+{r.withheld} withheld)" if r.withheld else ""
        problems.append(
            f"{len(r.tokens)} tokens streamed{withheld}, {r.tokens_predicted} reported, {n_predict} asked"
        )
    if r.tokens_evaluated != prompt_len:
        problems.append(f"{r.tokens_evaluated} prompt tokens evaluated, {prompt_len} sent")
    if problems:
        raise RuntimeError("llama-server reply does not match the request: " + "; ".join(problems))


def summarize_replies(replies: list[Reply], sent_at: float, finished_at: float, prompt_tokens: int) -> dict:
    """One run's counts, in the shape of throughput.run_offline's (TTFT from when all were sent)."""
    ttfts = sorted(r.first_token_at - sent_at for r in replies if r.first_token_at is not None)
    run = {
        "elapsed_time": finished_at - sent_at,
        "num_requests": len(replies),
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(len(r.tokens) + r.withheld for r in replies),
        "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else 0.0,
    }
    decode = sorted(
        (len(r.tokens) + r.withheld - 1) / (r.finished_at - r.first_token_at)
        for r in replies
        if len(r.tokens) > 1 and r.first_token_at is not None and r.finished_at > r.first_token_at
    )
    run["decode_tokens_per_second"] = decode[len(decode) // 2] if decode else 0.0
    return run


async def _complete(client: httpx.AsyncClient, url: str, ids: list[int], n: int) -> Reply:
    async with client.stream("POST", url, json=request_body(ids, n)) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"llama-server: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        lines = [(time.perf_counter(), line) async for line in resp.aiter_lines()]
    reply = parse_stream(lines)
    check_reply(reply, len(ids), n)
    return reply


async def run_workload(base_url: str, ids: list[list[int]], max_tokens: list[int]) -> dict:
    """Every prompt at once, one streamed request each; the run's counts and wall time."""
    limits = httpx.Limits(max_connections=len(ids), max_keepalive_connections=len(ids))
    timeout = httpx.Timeout(None, connect=10.0)  # a long workload is not an error
    # trust_env=False: a proxy from the environment must not stand between us and a loopback server
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(_complete(client, base_url + "/completion", x, n) for x, n in zip(ids, max_tokens))
        )
        end = time.perf_counter()
    return summarize_replies(list(replies), start, end, sum(map(len, ids)))


@contextmanager
def launched(cmd: list[str], startup_timeout_s: float = 300.0) -> Iterator[str]:
    """Start llama-server, wait for its /health, yield its base URL; always stop it afterwards (its log,
    in a temporary file, is shown when it fails to start)."""
    port = int(cmd[cmd.index("--port") + 1])
    env = library_env(Path(cmd[0]))
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, proc, startup_timeout_s, log.name)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        os.unlink(log.name)


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    """/health answers 503 while the model loads, 200 once the slots are ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text()[-2000:]
            raise RuntimeError(f"llama-server exited with {proc.returncode} during start-up:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server did not become healthy within {timeout_s:.0f}s")


def run_llama_server(
    binary: Path, model_path: Path, prompts: list[BenchPrompt], threads: int = 2, repeat: int = 1
) -> list[dict]:
    """`repeat` runs of the whole workload on one server (warmed up by one short request first)."""
    ids = prompt_token_ids(prompts, model_path)
    max_tokens = [p.max_tokens for p in prompts]
    slots = min(len(ids), MAX_SLOTS)
    cmd = server_command(binary, model_path, free_port(), slots, context_per_slot(ids, max_tokens), threads)
    print("llama.cpp:", " ".join(cmd))
    start = time.perf_counter()
    with launched(cmd) as base_url:
        load_time_s = time.perf_counter() - start  # start to ready: process start until /health answers ok
        asyncio.run(run_workload(base_url, ids[:1], [2]))  # warm-up: first-call costs, not timed
        runs = [asyncio.run(run_workload(base_url, ids, max_tokens)) for _ in range(repeat)]
    # in the JSON, beside the figures; llama.cpp multiplies the file's own blocks, so their bytes are what
    # a decode step streams
    extra = {"slots": slots, "threads": threads, "load_time_s": load_time_s}
    extra["bytes_per_token"] = gguf_bytes_per_token(model_path)
    return [run | extra for run in runs]
