"""Online serving benchmark, like `vllm bench serve`: stream requests at an OpenAI-compatible server.

Requests arrive as a Poisson process (--request-rate, or all at once for inf), at most --max-concurrency
in flight. Each is streamed (SSE) so that we see when every chunk arrives: TTFT is the first chunk,
ITL the gaps between chunks, E2EL the whole request, TPOT = (E2EL - TTFT) / (output tokens - 1).
Output tokens come from the server's usage (stream_options.include_usage), as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from pagedllm.bench.dataset import BenchPrompt


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between chunks
    latency: float = 0.0  # E2EL, seconds
    error: str = ""


def _payload(endpoint: str, model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool) -> dict:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,  # vLLM's extension; an OpenAI server ignores unknown fields
    }
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict[str, str],
    prompt_len: int,
) -> RequestResult:
    """POST one streaming request and time its chunks; never raises (errors land in the result)."""
    out = RequestResult(prompt_len=prompt_len)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                now = time.perf_counter()
                choices = chunk.get("choices")
                if choices and (choices[0].get("delta") or {}).get("role"):
                    choices = None  # chat's opening chunk carries the role, sent before any token exists
                if choices:
                    # Like vLLM: every chunk with a choice counts, even one whose text the detokenizer held back.
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = usage.get("completion_tokens", chunks)
                    out.prompt_len = usage.get("prompt_tokens", prompt_len)
        out.latency = time.perf_counter() - start
        out.output_tokens = out.output_tokens or chunks
        out.success = chunks > 0
        if not out.success:
            out.error = "no chunk received"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _arrivals(n: int, request_rate: float, seed: int):
    """Yield 0..n-1, sleeping exponential gaps between them (Poisson arrivals at request_rate/s)."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if request_rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.expovariate(request_rate))


async def run_serve(
    base_url: str,
    endpoint: str,
    model: str,
    prompts: list[BenchPrompt],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    api_key: str | None = None,
    seed: int = 0,
    use_tqdm: bool = True,
    timeout_s: float = 600.0,
) -> dict:
    """Run the prompts against the server; returns vLLM's report keys (see summarize)."""
    url = base_url.rstrip("/") + endpoint
    if endpoint.endswith("chat/completions") and any(isinstance(p.prompt, list) for p in prompts):
        raise ValueError("chat messages need text prompts: decode token-id prompts first")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    # enough connections for every request in flight; no pool wait hides in the TTFT
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    bar = tqdm(
        total=len(prompts), desc=f"bench serve (concurrency {limit})", unit="req", disable=not use_tqdm
    )
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(p: BenchPrompt) -> RequestResult:
            async with sem:
                body = _payload(endpoint, model, p.prompt, p.max_tokens, ignore_eos)
                plen = len(p.prompt) if isinstance(p.prompt, list) else 0
                r = await send_request(client, url, body, headers, plen)
            bar.update(1)
            return r

        # warm-up: one short request, not counted (first-call costs: connection, lazy init)
        warm = _payload(endpoint, model, prompts[0].prompt, 2, ignore_eos)
        w = await send_request(client, url, warm, headers, 0)
        if not w.success:
            bar.close()
            raise ConnectionError(f"warm-up request to {url} failed: {w.error}")

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), request_rate, seed):
            tasks.append(asyncio.create_task(one(prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    report = summarize(results, duration)
    report.update(request_rate=request_rate, max_concurrency=max_concurrency, endpoint=endpoint, model=model)
    return report


def _stats(name: str, values_s: list[float]) -> dict:
    """mean/median/std/p99 of values in seconds, reported in ms under vLLM's key names."""
    ms = sorted(v * 1000 for v in values_s) or [0.0]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    report = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", itls),
        **_stats("e2el", [r.latency for r in ok]),
        # the raw lists, as vLLM saves them: the plots read these
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "errors": [r.error for r in results],
    }
    return report


def format_report(r: dict) -> str:
    """The table `vllm bench serve` prints."""
    rows = [
        ("Successful requests", f"{r['completed']}"),
        ("Failed requests", f"{r['failed']}"),
        ("Maximum request concurrency", f"{r.get('max_concurrency')}"),
        ("Benchmark duration (s)", f"{r['duration']:.2f}"),
        ("Total input tokens", f"{r['total_input_tokens']}"),
        ("Total generated tokens", f"{r['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
    ]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)")):
        rows += [(f"-- {title} --", "")]
        rows += [
            (f"{s.capitalize()} {name.upper()} (ms)", f"{r[f'{s}_{name}_ms']:.2f}")
            for s in ("mean", "median")
        ]
        rows += [(f"P99 {name.upper()} (ms)", f"{r[f'p99_{name}_ms']:.2f}")]
    for name, title in (("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows += [(f"-- {title} --", "")]
        rows += [
            (f"{s.capitalize()} {name.upper()} (ms)", f"{r[f'{s}_{name}_ms']:.2f}")
            for s in ("mean", "median")
        ]
        rows += [(f"P99 {name.upper()} (ms)", f"{r[f'p99_{name}_ms']:.2f}")]
    title = " Serving Benchmark Result "
    return "\n".join([f"{title:=^52}", *(f"{k:<40}{v:>12}" for k, v in rows), "=" * 52])
