"""Soak test (a benchmark, not a test): mixed traffic against one real server for many minutes.

    .venv/bin/python scripts/soak_server.py --minutes 20 --output-json /tmp/soak.json

Starts `pagedllm serve` (the default model unless --model; repeat --model NAME=PATH for a server of several
models, each request then names one at random), then runs --workers clients at once, each
picking at random: a streamed chat answer read to the end, a stream dropped after a few chunks, a
non-streaming completion (short or long prompt, n=1..3), a /tokenize of a long text, or a bad input (NaN,
a lone surrogate, an unknown role, n=1000, a 20 MB body, a stalled header). It records every status,
samples the server's RSS every 10 s, and at the end waits for the engine to drain and reads /metrics.

Pass if: no 5xx and no unexpected status, RSS at the end at most 5% above RSS after the first minute (it
swings by about that much with the work in flight, so a drop is no failure), every KV block free with
nothing running or waiting at the end, and exit status 0 after SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.bench.launch import free_port

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2" / "test.txt"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def corpus() -> str:
    if TEXT.exists():
        return TEXT.read_text(errors="replace")
    return "The paged KV cache stores keys and values in fixed-size blocks. " * 2000


class Soak:
    def __init__(self, base: str, models: list[str], rng: random.Random, text: str):
        self.base = base
        self.models = models
        self.rng = rng
        self.text = text
        self.statuses: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []

    @property
    def model(self) -> str:
        """The served name a request sends: one of the server's models, at random."""
        return self.models[0] if len(self.models) == 1 else self.rng.choice(self.models)

    def note(self, kind: str, status: int | str, expected: set[int]) -> None:
        self.statuses[f"{kind} {status}"] += 1
        if status not in expected:
            self.unexpected.append(f"{kind}: {status}")

    def prompt(self, long: bool) -> str:
        n = self.rng.randrange(2000, 6000) if long else self.rng.randrange(20, 200)
        start = self.rng.randrange(max(1, len(self.text) - n))
        return self.text[start : start + n]

    async def stream_chat(self, client: httpx.AsyncClient, drop: bool) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt(False)}],
            "max_tokens": self.rng.randrange(16, 128),
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data:")
                if drop and chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        self.note("stream-drop" if drop else "stream", r.status_code, {200, 503})

    async def complete(self, client: httpx.AsyncClient) -> None:
        body = {
            "model": self.model,
            "prompt": self.prompt(self.rng.random() < 0.3),
            "max_tokens": self.rng.randrange(8, 64),
            "n": self.rng.randrange(1, 4),
            "temperature": self.rng.choice([0, 0.7, 1.0]),
        }
        r = await client.post("/v1/completions", json=body)
        self.note("completion", r.status_code, {200, 503})

    async def tokenize(self, client: httpx.AsyncClient) -> None:
        r = await client.post("/tokenize", json={"prompt": self.text[: self.rng.randrange(10_000, 400_000)]})
        self.note("tokenize", r.status_code, {200})

    async def bad(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choice(["nan", "surrogate", "role", "n", "big", "stall"])
        headers = {**AUTH, "Content-Type": "application/json"}
        if kind == "nan":
            content = f'{{"model": "{self.model}", "prompt": "x", "temperature": NaN}}'.encode()
            r = await client.post("/v1/completions", content=content, headers=headers)
            self.note("bad-nan", r.status_code, {400})
        elif kind == "surrogate":
            content = f'{{"model": "{self.model}", "prompt": "x \\ud800"}}'.encode()
            r = await client.post("/v1/completions", content=content, headers=headers)
            self.note("bad-surrogate", r.status_code, {400})
        elif kind == "role":
            body = {"model": self.model, "messages": [{"role": "wizard", "content": "hi"}]}
            r = await client.post("/v1/chat/completions", json=body)
            self.note("bad-role", r.status_code, {400})
        elif kind == "n":
            r = await client.post("/v1/completions", json={"model": self.model, "prompt": "x", "n": 1000})
            self.note("bad-n", r.status_code, {400})
        elif kind == "big":
            try:
                r = await client.post("/v1/completions", content=b"x" * (20 * 2**20), headers=headers)
                self.note("bad-20MB", r.status_code, {413})
            except httpx.HTTPError:  # the server answered 413 and closed while we were still sending
                self.note("bad-20MB", "closed", {"closed"})  # type: ignore[arg-type]
        else:
            host, port = self.base.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), timeout=60)  # the server closes it
            writer.close()
            self.note("bad-stall", "closed" if not data else "answered", {"closed"})  # type: ignore[arg-type]

    async def worker(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.base, headers=AUTH, timeout=300) as client:
            while time.monotonic() < deadline:
                pick = self.rng.random()
                try:
                    if pick < 0.35:
                        await self.stream_chat(client, drop=False)
                    elif pick < 0.45:
                        await self.stream_chat(client, drop=True)
                    elif pick < 0.75:
                        await self.complete(client)
                    elif pick < 0.85:
                        await self.tokenize(client)
                    else:
                        await self.bad(client)
                except httpx.HTTPError as e:
                    self.note("transport", type(e).__name__, set())


async def soak(base: str, models: list[str], workers: int, minutes: float, pid: int, seed: int) -> dict:
    rng = random.Random(seed)
    s = Soak(base, models, rng, corpus())
    start = time.monotonic()
    deadline = start + minutes * 60
    rss: list[tuple[float, int]] = []

    async def sample() -> None:
        while time.monotonic() < deadline:
            rss.append((time.monotonic() - start, rss_bytes(pid)))
            print(
                f"{rss[-1][0]:6.0f} s  rss {rss[-1][1] / 2**20:7.1f} MiB  {sum(s.statuses.values())} requests",
                flush=True,
            )
            await asyncio.sleep(10)

    await asyncio.gather(sample(), *(s.worker(deadline) for _ in range(workers)))
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as client:
        for _ in range(120):  # the engine drains what the dropped streams left
            metrics = _summed(_parse((await client.get("/metrics")).text))
            if (
                metrics["pagedllm:num_requests_running"] == 0
                and metrics["pagedllm:num_requests_waiting"] == 0
            ):
                break
            await asyncio.sleep(1)
    after_first_minute = next((b for t, b in rss if t >= 60), rss[0][1])
    end = rss_bytes(pid)
    return {
        "minutes": minutes,
        "workers": workers,
        "requests": sum(s.statuses.values()),
        "statuses": dict(sorted(s.statuses.items())),
        "server_errors": sum(
            v for k, v in s.statuses.items() if k.split()[-1].startswith("5") and k.split()[-1] != "503"
        ),
        "unexpected": s.unexpected[:20],
        "num_unexpected": len(s.unexpected),
        "rss_after_first_minute": after_first_minute,
        "rss_end": end,
        "rss_growth": end / after_first_minute - 1,
        "rss_range_minutes_1_3": _range(rss, 60, 180),
        "rss_range_last_3_minutes": _range(rss, minutes * 60 - 180, minutes * 60),
        "blocks_total": metrics["pagedllm:kv_cache_blocks_total"],
        "blocks_free_end": metrics["pagedllm:kv_cache_blocks_free"],
        "running_end": metrics["pagedllm:num_requests_running"],
        "waiting_end": metrics["pagedllm:num_requests_waiting"],
        "rss_samples": rss,
    }


def _range(samples: list[tuple[float, int]], start: float, end: float) -> list[int]:
    """[min, max] RSS of the samples taken between start and end seconds."""
    values = [b for t, b in samples if start <= t < end] or [0]
    return [min(values), max(values)]


def _summed(samples: dict[str, float]) -> dict[str, float]:
    """Each `name{labels}` also as `name`, summed over its labels (a server of several models labels every
    engine metric with model_name); an unlabelled name stays as it is."""
    out = dict(samples)
    sums: dict[str, float] = collections.defaultdict(float)
    for key, value in samples.items():
        if "{" in key:
            sums[key.split("{", 1)[0]] += value
    for name, value in sums.items():
        out.setdefault(name, value)
    return out


def _parse(text: str) -> dict[str, float]:
    """/metrics as `name{labels}` -> value, the way Prometheus reads it."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--model", action="append", help="NAME=PATH or PATH; repeat it for several models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("server_args", nargs="*", help="more `pagedllm serve` flags, after --")
    args = ap.parse_args()
    models = args.model or ["default"]
    names = [m.partition("=")[0] if "=" in m else m for m in models]
    port = free_port()
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.server", *(a for m in models for a in ("--model", m)),
        "--port", str(port), "--api-key", KEY, "--log-level", "warning", "--num-kv-blocks", "1024",
        "--max-model-len", "4096", "--max-num-seqs", "16", *args.server_args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        report = asyncio.run(soak(base, names, args.workers, args.minutes, proc.pid, args.seed))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    report["exit_status_after_sigterm"] = code
    summary = {k: v for k, v in report.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    ok = (
        report["server_errors"] == 0
        and report["num_unexpected"] == 0
        and report["rss_growth"] <= 0.05  # RSS swings with the work in flight; only growth is a leak
        and report["blocks_free_end"] == report["blocks_total"]
        and report["running_end"] == report["waiting_end"] == 0
        and code == 0
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
