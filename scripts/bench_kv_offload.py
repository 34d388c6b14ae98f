"""TTFT of a long prompt on a fresh server, then on a new server started on the same --kv-offload-dir
(issue 38: at most 0.6x), and once more on that server (an in-memory prefix-cache hit), for reference.

    python scripts/bench_kv_offload.py [--repeat 90] [--model default] [-- extra server args]

Streams one chat request each time; TTFT = request sent to the first content delta. With --offline: the
same with offline engines in this process, timing the engine steps to the first token, wall and CPU
(process) time: on a shared machine the CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, kv_dir: str, extra: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--kv-offload-dir", kv_dir, *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited during start-up (log: {log.name})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become healthy")


def ttft(url: str, text: str) -> tuple[float, str, int]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, out, cached = None, "", -1
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content") or ""
                if delta and first is None:
                    first = time.perf_counter() - t0
                out += delta
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, out, cached


def offline(model: str, text: str, rounds: int) -> None:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    def first_token(engine, rid: str) -> tuple[float, float, int]:
        engine.add_request(rid, text, SamplingParams(temperature=0, max_tokens=1))
        w, c = time.perf_counter(), time.process_time()
        out = None
        while engine.has_unfinished_requests():
            out = engine.step() or out
        return time.perf_counter() - w, time.process_time() - c, out[0].num_cached_tokens

    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as kv_dir:
            e = LLMEngine(model=model, show_progress=False, kv_offload_dir=kv_dir)
            e.warm_up()
            cold = first_token(e, "cold")
            e.shutdown()
            e = LLMEngine(model=model, show_progress=False, kv_offload_dir=kv_dir)
            e.warm_up()
            disk = first_token(e, "disk")
            memory = first_token(e, "memory")
            e.shutdown()
        for name, (w, c, cached) in (("cold", cold), ("from disk", disk), ("in memory", memory)):
            print(f"{name:10s} wall {w * 1000:8.1f} ms  cpu {c * 1000:8.1f} ms  cached_tokens {cached}")
        print(f"from disk / cold: wall {disk[0] / cold[0]:.2f}x, cpu {disk[1] / cold[1]:.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--repeat", type=int, default=90, help="sentences in the prompt (90: about 1,700 tokens)")
    p.add_argument("--rounds", type=int, default=1, help="fresh directory and servers each round")
    p.add_argument("extra", nargs="*", help="more server options (after --)")
    p.add_argument("--offline", action="store_true", help="offline engines in this process, not servers")
    args = p.parse_args()
    text = " ".join(
        f"Note {i} on rivers: the quick brown fox jumps over the lazy dog by the river."
        for i in range(args.repeat)
    )
    if args.offline:
        offline(args.model, text, args.rounds)
        return
    ratios = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as kv_dir, open(os.path.join(kv_dir, "server.log"), "ab") as log:
            proc, url = start(args.model, kv_dir, args.extra, log)
            cold = ttft(url, text)
            proc.terminate()
            proc.wait(60)
            proc, url = start(args.model, kv_dir, args.extra, log)
            disk = ttft(url, text)
            memory = ttft(url, text)
            proc.terminate()
            proc.wait(60)
        for name, (t, out, cached) in (("cold", cold), ("from disk", disk), ("in memory", memory)):
            print(f"{name:10s} TTFT {t * 1000:8.1f} ms  cached_tokens {cached:5d}  text {out!r}")
        ratios.append(disk[0] / cold[0])
        print(f"from disk / cold = {ratios[-1]:.2f}x", flush=True)
    print(f"median from disk / cold over {len(ratios)} rounds: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
