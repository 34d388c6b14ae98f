"""The server tests of test_server.py, in-process against the fake engine (fast; no model needed).

Plus what only a fake can show: an engine step that raises fails its requests but not the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import FakeEngine, serve_in_thread
from test_server import *  # noqa: F403 - run every server test against the fake too
from test_server import API_KEY, ServerInfo, assert_good_request

from pagedllm.engine.async_engine import AsyncEngine

pytestmark = []  # fast: not "slow" like the real-server tests


@pytest.fixture(scope="module")
def server() -> Iterator[ServerInfo]:  # noqa: F811 - replaces the real server of test_server.py
    # step_delay: a 1000-token request takes seconds, so a client can drop in the middle of it
    engine = AsyncEngine(FakeEngine(max_model_len=2048, num_kv_blocks=4096, max_num_seqs=8, step_delay=0.002))
    with serve_in_thread(engine, api_key=API_KEY) as (base_url, thread):
        yield ServerInfo(base_url=base_url, model="fake", long_max_tokens=1000)
    assert not thread.is_alive()
    assert not engine.is_running  # the lifespan shutdown stopped the engine loop


def test_engine_step_error_fails_requests_not_the_server(server: ServerInfo) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=server.api_key, max_retries=0, timeout=30)
    r = httpx.post(
        server.url("/v1/completions"),
        json={"model": server.model, "prompt": "__boom__", "max_tokens": 4, "stream": True},
        headers=server.headers,
        timeout=30,
    )
    assert r.status_code == 200  # headers went out before the step failed: the error comes in-band
    assert '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=server.model, prompt="__boom__", max_tokens=4)
    assert_good_request(client, server)


def test_default_max_tokens_fills_the_context(server: ServerInfo) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=server.api_key, max_retries=0, timeout=30)
    r = client.completions.create(model=server.model, prompt="ab", extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 2048  # max_model_len of the fake


def test_stop_strings(server: ServerInfo) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=server.api_key, max_retries=0, timeout=30)
    r = client.completions.create(model=server.model, prompt="hello world", stop=[" "], max_tokens=20)
    assert r.choices[0].text == "hello" and r.choices[0].finish_reason == "stop"


def test_graceful_shutdown_finishes_in_flight() -> None:
    import asyncio

    from pagedllm.sampling_params import SamplingParams

    async def main() -> None:
        engine = AsyncEngine(FakeEngine(step_delay=0.001))
        outputs = []

        async def consume() -> None:
            async for out in engine.generate("abcdef", SamplingParams(max_tokens=5), "r1"):
                outputs.append(out)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # let it queue
        while not engine.num_in_flight and not task.done():
            await asyncio.sleep(0.001)
        await engine.shutdown(timeout=10)
        await asyncio.wait_for(task, 10)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        with pytest.raises(Exception, match="shutting down"):
            await engine.add_request("r2", "x", SamplingParams())

    asyncio.run(main())


def test_cancelled_consumer_aborts() -> None:
    import asyncio

    from pagedllm.sampling_params import SamplingParams

    async def main() -> None:
        fake = FakeEngine(step_delay=0.001)
        engine = AsyncEngine(fake)

        async def consume() -> None:
            params = SamplingParams(max_tokens=100000, ignore_eos=True)
            async for _ in engine.generate("abc", params, "r1"):
                pass

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + 10
        while (
            engine.get_stats() is None or engine.get_stats().num_running == 0
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.get_stats().num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.get_stats().num_running == 0 and engine.num_in_flight == 0
        await engine.shutdown(timeout=5)

    asyncio.run(main())


def test_shutdown_aborts_what_does_not_finish_in_time() -> None:
    import asyncio

    from pagedllm.engine.async_engine import RequestFailedError
    from pagedllm.sampling_params import SamplingParams

    async def main() -> None:
        engine = AsyncEngine(FakeEngine(step_delay=0.001))
        stream = await engine.add_request("r1", "abc", SamplingParams(max_tokens=100000, ignore_eos=True))
        await stream.__anext__()
        await engine.shutdown(timeout=0.2)
        with pytest.raises(RequestFailedError, match="shutting down"):
            async for _ in stream:
                pass
        assert not engine.is_running

    asyncio.run(asyncio.wait_for(main(), 30))


def _read_response(sock) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "connection closed inside a response body"
        body += chunk
    return int(head.split()[1]), body


def test_a_500_keeps_the_connection_for_the_next_request(server: ServerInfo) -> None:
    import json
    import socket

    host, port = server.base_url.removeprefix("http://").split(":")

    def request(prompt: str) -> bytes:
        body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": 2}).encode()
        return (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request("__crash__"))
        status, body = _read_response(sock)
        assert status == 500 and json.loads(body)["error"]["code"] == 500
        sock.sendall(request("hello"))  # the same keep-alive connection
        status, body = _read_response(sock)
        assert status == 200 and json.loads(body)["choices"], body
