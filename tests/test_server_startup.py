"""Start-up: the StartupGate answers 503 (an OpenAI-style body) until the app is ready, the real server's
/health goes 503 -> 200 and never back, and LLMEngine.warm_up() leaves no trace in the engine's state.

No test measures time: every wait is a bounded poll.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from test_server import stop_server

from pagedllm import SamplingParams
from pagedllm.entrypoints.openai.server import StartupGate

STARTUP_TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[1]


def run(coro):
    return asyncio.run(coro)


async def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gate") as client:
        return await client.request(method, path, **kwargs)


def assert_loading_503(r: httpx.Response) -> None:
    assert r.status_code == 503
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert "loading" in err["message"]
    assert err["code"] == 503
    assert err["type"] == "ServiceUnavailableError"


# ---- the gate, in-process ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 1}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
        ),
        ("GET", "/no/such/route", None),
    ],
)
def test_gate_answers_503_while_loading(method, path, body):
    gate = StartupGate()
    assert gate.app is None
    assert_loading_503(run(request(gate, method, path, json=body)))


def test_gate_forwards_everything_once_the_app_is_set():
    app = FastAPI()
    seen = []

    @app.get("/health")
    async def health():
        seen.append("/health")
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(payload: dict):
        seen.append("/v1/completions")
        return {"echo": payload}

    gate = StartupGate()
    assert_loading_503(run(request(gate, "GET", "/health")))
    assert seen == []  # the 503 came from the gate, not the app
    gate.app = app
    r = run(request(gate, "GET", "/health"))
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = run(request(gate, "POST", "/v1/completions", json={"prompt": "x"}))
    assert r.status_code == 200 and r.json() == {"echo": {"prompt": "x"}}
    assert run(request(gate, "GET", "/missing")).status_code == 404  # the app's own 404, not a 503
    assert seen == ["/health", "/v1/completions"]


# ---- the real server ---------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_server_health_goes_503_then_200_and_stays(tmp_path):
    port = free_port()
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.server",
        "--model", "default", "--host", "127.0.0.1", "--port", str(port),
        "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-model-len", "512", "--log-level", "warning",
    ]  # fmt: skip
    # The API has no WebSocket route, so the server must not need a websockets library: this one imports
    # but lacks a module (as a half-installed one did on a CI machine), and the server starts all the same.
    broken = tmp_path / "broken_site" / "websockets"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "server.py").write_text("from .streams import StreamReader  # no streams.py here\n")
    path = [str(REPO), str(broken.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    log = tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}/health"
    seen: list[int] = []  # status codes, in order; connection errors are not answers
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        oks_after_ready = 0
        last: httpx.Response | None = None
        while oks_after_ready < 5:
            assert time.monotonic() < deadline, (
                f"no steady 200 in {STARTUP_TIMEOUT_S}s; saw {seen}\n{log.read_text()}"
            )
            assert proc.poll() is None, f"server exited ({proc.returncode}); saw {seen}\n{log.read_text()}"
            try:
                last = httpx.get(url, timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append(last.status_code)
            if last.status_code == 503:
                assert_loading_503(last)
            if last.status_code == 200:
                oks_after_ready += 1
            time.sleep(0.05)
        assert seen[0] in (503, 200), seen
        assert set(seen) <= {503, 200}, seen
        first_ok = seen.index(200)
        assert all(code == 200 for code in seen[first_ok:]), f"503 after a 200: {seen}"
        assert last is not None and last.status_code == 200 and last.json() == {"status": "ok"}
        # a WebSocket upgrade is answered as plain HTTP (no 101 switch), and the server goes on
        upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
        r = httpx.get(url, headers=upgrade, timeout=5)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        assert proc.poll() is None
    finally:
        stop_server(proc)


# ---- LLMEngine.warm_up -------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "The capital of France is"


def first_output(engine) -> tuple[list[int], int]:
    """The greedy tokens of the engine's first request, and the prefix-cache hits it got."""
    engine.add_request("first", PROMPT, GREEDY)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final.outputs[0].token_ids, engine.get_stats().prefix_cache_hits


@pytest.mark.slow
def test_warm_up_leaves_no_trace_and_changes_no_output():
    from pagedllm.engine.llm_engine import LLMEngine

    warm = LLMEngine(model="default", num_kv_blocks=64, show_progress=False)
    warm.warm_up()
    stats = warm.get_stats()
    assert stats.num_free_blocks == stats.num_blocks_total == 64
    assert stats.num_cached_free_blocks == 0
    assert warm.scheduler.kv_cache_manager.block_pool.stats().num_cached_blocks == 0
    assert stats.prefix_cache_queries == 0 and stats.prefix_cache_hits == 0
    assert stats.num_running == stats.num_waiting == 0
    assert not warm.has_unfinished_requests()

    warm_tokens, warm_hits = first_output(warm)
    fresh = LLMEngine(model="default", num_kv_blocks=64, show_progress=False)
    fresh_tokens, fresh_hits = first_output(fresh)
    assert len(warm_tokens) == GREEDY.max_tokens
    assert warm_tokens == fresh_tokens
    assert warm_hits == fresh_hits == 0

    # and it refuses to run once a request is waiting
    warm.add_request("pending", PROMPT, GREEDY)
    with pytest.raises(RuntimeError, match="before any request"):
        warm.warm_up()
