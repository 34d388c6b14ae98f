"""The OpenAI-compatible server, end to end, through the official `openai` client.

The `server` fixture here starts the real thing as a subprocess
(`python -m pagedllm.entrypoints.openai.server --model default ...`) on 127.0.0.1 and a free port.
tests/test_server_fake.py runs these same tests in-process against tests/fake_engine.py.

No test measures time: every wait is a bounded poll with a generous timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120

pytestmark = pytest.mark.slow


@dataclass
class ServerInfo:
    base_url: str  # http://127.0.0.1:PORT
    model: str
    api_key: str = API_KEY
    # disconnect test: a request this long is still running when the client drops
    long_max_tokens: int = 1000
    process: subprocess.Popen | None = None  # the server's process, when the test started one

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_healthy(base_url: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    def healthy() -> bool:
        if not alive():
            raise AssertionError("server process exited during start-up")
        try:
            return httpx.get(base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout, "/health")


@contextlib.contextmanager
def running_server(log: Path, *args: str, model: str = "default") -> Iterator[ServerInfo]:
    """The real server (`python -m pagedllm.entrypoints.openai.server`) on 127.0.0.1 and a free port,
    with the API key and `args`; stopped on exit. Its log goes to `log` and is shown if it fails to start."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
        "--log-level", "warning", *args,
    ]  # fmt: skip
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=repo, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base_url, STARTUP_TIMEOUT_S, alive=lambda: proc.poll() is None)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- server log ---\n{log.read_text()[-5000:]}") from None
        yield ServerInfo(base_url=base_url, model=model, long_max_tokens=1000, process=proc)
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within 30 s; its exit status."""
    if proc.poll() is not None:
        return proc.returncode
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """The real server with SmolLM2-135M ("default"), kept light on KV blocks and batch size."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(
        log, "--num-kv-blocks", "512", "--max-num-seqs", "32", "--max-model-len", "2048"
    ) as info:
        yield info


@pytest.fixture
def client(server: ServerInfo) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(
        base_url=server.url("/v1"), api_key=server.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    yield c
    c.close()


def read_metrics(server: ServerInfo) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of /metrics."""
    text = httpx.get(server.url("/metrics"), headers=server.headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def num_tokens(server: ServerInfo, prompt: str) -> int:
    r = httpx.post(server.url("/tokenize"), json={"prompt": prompt}, headers=server.headers, timeout=10)
    r.raise_for_status()
    return r.json()["count"]


def assert_good_request(client: openai.OpenAI, server: ServerInfo) -> None:
    """The server still serves after an error."""
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices and r.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------- small routes


def test_health_version_models(server: ServerInfo, client: openai.OpenAI) -> None:
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    version = httpx.get(server.url("/version"), headers=server.headers, timeout=10).json()["version"]
    assert re.match(r"\d+\.\d+", version)
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].object == "model"


def test_tokenize_detokenize_round_trip(server: ServerInfo) -> None:
    text = "Paged attention keeps the KV cache in blocks."
    r = httpx.post(
        server.url("/tokenize"),
        json={"model": server.model, "prompt": text},
        headers=server.headers,
        timeout=10,
    ).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > r["count"]
    no_special = httpx.post(
        server.url("/tokenize"),
        json={"prompt": text, "add_special_tokens": False},
        headers=server.headers,
        timeout=10,
    ).json()["tokens"]
    back = httpx.post(
        server.url("/detokenize"), json={"tokens": no_special}, headers=server.headers, timeout=10
    ).json()["prompt"]
    assert back.strip() == text
    chat = httpx.post(
        server.url("/tokenize"),
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=server.headers,
        timeout=10,
    )
    assert chat.status_code == 200 and chat.json()["count"] > 1


def test_metrics_names(server: ServerInfo) -> None:
    text = httpx.get(server.url("/metrics"), headers=server.headers, timeout=10).text
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_cache_blocks_total",
        "kv_cache_blocks_free",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
    ]:
        assert f"\npagedllm:{name}" in text, name
    assert read_metrics(server)["pagedllm:kv_cache_blocks_total"] > 0


# ---------------------------------------------------------------------------------------------- completions


def test_completion_usage(server: ServerInfo, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == num_tokens(server, prompt)
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_max_tokens_is_length(server: ServerInfo, client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=server.model,
        prompt="Once upon a time",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_completion_stream_equals_non_stream(server: ServerInfo, client: openai.OpenAI) -> None:
    kwargs = dict(model=server.model, prompt="The three primary colors are", max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage is not None  # the usage chunk comes last
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_n2(server: ServerInfo, client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=server.model, prompt="My favourite animal is", n=2, max_tokens=6, temperature=0.8, seed=1
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    stream = client.completions.create(
        model=server.model,
        prompt="My favourite animal is",
        n=2,
        max_tokens=6,
        temperature=0.8,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = {0: "", 1: ""}, {0: 0, 1: 0}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
    assert finishes == {0: 1, 1: 1}
    assert usage is not None and usage.completion_tokens >= 2


def test_completion_batch_and_token_prompts(server: ServerInfo, client: openai.OpenAI) -> None:
    ids = httpx.post(
        server.url("/tokenize"), json={"prompt": "Hello there"}, headers=server.headers, timeout=10
    ).json()["tokens"]
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=server.model, prompt="Hello there", max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)

    batch = client.completions.create(
        model=server.model, prompt=["One", "Two", "Three"], max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2]
    batch_ids = client.completions.create(
        model=server.model,
        prompt=[ids, ids],
        n=2,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in batch_ids.choices) == [0, 1, 2, 3]
    assert batch_ids.usage.prompt_tokens == 2 * len(ids)
    assert batch_ids.usage.completion_tokens == 4 * 3


def test_completion_echo_and_logprobs(server: ServerInfo, client: openai.OpenAI) -> None:
    r = client.completions.create(model=server.model, prompt="Hi", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hi")
    r = client.completions.create(model=server.model, prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_async_completion(server: ServerInfo) -> None:
    async def main() -> str:
        async with openai.AsyncOpenAI(
            base_url=server.url("/v1"), api_key=server.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
        ) as c:
            r = await c.completions.create(
                model=server.model, prompt="Water boils at", max_tokens=5, temperature=0
            )
            return r.choices[0].text

    assert isinstance(asyncio.run(main()), str)


# ---------------------------------------------------------------------------------------------- chat


def test_chat_stream_equals_non_stream(server: ServerInfo, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    kwargs = dict(model=server.model, messages=messages, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n2_and_logprobs(server: ServerInfo, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say something."}],
        n=2,
        max_completion_tokens=5,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        content = choice.logprobs.content
        assert content and all(len(t.top_logprobs) == 2 for t in content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)

    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Say something."}],
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    roles, finishes = {0: 0, 1: 0}, {0: 0, 1: 0}
    for chunk in stream:
        for c in chunk.choices:
            roles[c.index] += c.delta.role == "assistant"
            finishes[c.index] += c.finish_reason is not None
    assert roles == {0: 1, 1: 1} and finishes == {0: 1, 1: 1}


def test_concurrent_streaming_chats(server: ServerInfo) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await c.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text, finishes = "", 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finishes += choice.finish_reason is not None
        return text, finishes

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=server.url("/v1"), api_key=server.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
        ) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(32))), timeout=600)

    results = asyncio.run(main())
    assert len(results) == 32 and all(finishes == 1 for _, finishes in results)


# ---------------------------------------------------------------------------------------------- errors


BAD_COMPLETIONS = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 10**6}, "max_tokens"),  # prompt + max_tokens beyond the context
    ({"temperature": "hot"}, "temperature"),  # mistyped
    ({"prompt": []}, "prompt"),
]


@pytest.mark.parametrize(
    "bad,param", BAD_COMPLETIONS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_COMPLETIONS)]
)
def test_bad_completion_is_400(server: ServerInfo, client: openai.OpenAI, bad: dict, param: str) -> None:
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 4, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    error = e.value.response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert error["message"]
    assert_good_request(client, server)


BAD_CHATS = [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"content": "no role"}]}, "messages"),
]


@pytest.mark.parametrize("bad,param", BAD_CHATS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_CHATS)])
def test_bad_chat_is_400(server: ServerInfo, client: openai.OpenAI, bad: dict, param: str) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.response.json()["error"]["param"] == param
    assert_good_request(client, server)


def test_bad_json_and_missing_field_are_400(server: ServerInfo, client: openai.OpenAI) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    r = httpx.post(server.url("/v1/completions"), content=b"{not json", headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(server.url("/v1/completions"), json={"model": server.model}, headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert_good_request(client, server)


def test_unknown_model_is_404(server: ServerInfo, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    error = e.value.response.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert_good_request(client, server)


def test_api_key_required(server: ServerInfo, client: openai.OpenAI) -> None:
    wrong = openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=server.model, prompt="Hello", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    r = httpx.post(server.url("/v1/completions"), json={"model": server.model, "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200  # probes need no key
    for path in ("/metrics", "/version", "/openapi.json"):  # everything else does
        assert httpx.get(server.url(path), timeout=10).status_code == 401, path
    assert httpx.post(server.url("/tokenize"), json={"prompt": "x"}, timeout=10).status_code == 401
    assert_good_request(client, server)


# ---------------------------------------------------------------------------------------------- disconnects


def test_client_disconnect_aborts_and_frees_blocks(server: ServerInfo) -> None:
    abort_key = 'pagedllm:request_success_total{finished_reason="abort"}'
    aborts_before = read_metrics(server).get(abort_key, 0.0)
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": server.long_max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        with http.stream("POST", server.url("/v1/completions"), json=body, headers=server.headers) as r:
            assert r.status_code == 200
            events: list[str] = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert "error" not in json.loads(line[6:]), line
                    events.append(line)
                if len(events) >= 3:
                    break  # leaving the block closes the connection mid-stream
    assert len(events) == 3, events

    def released() -> bool:
        m = read_metrics(server)
        return (
            m[abort_key] > aborts_before
            and m["pagedllm:num_requests_running"] == 0
            and m["pagedllm:num_requests_waiting"] == 0
            and m["pagedllm:kv_cache_blocks_free"] == m["pagedllm:kv_cache_blocks_total"]
        )

    wait_until(released, 60, "the dropped request to be aborted and its blocks freed")


def test_non_streaming_client_that_leaves_aborts(server: ServerInfo) -> None:
    abort_key = 'pagedllm:request_success_total{finished_reason="abort"}'
    aborts_before = read_metrics(server).get(abort_key, 0.0)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": server.long_max_tokens}
    # The client gives up long before a request this long can finish (that is the only timing here).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url("/v1/completions"),
            json={**body, "ignore_eos": True},
            headers=server.headers,
            timeout=0.5,
        )

    def released() -> bool:
        m = read_metrics(server)
        return m[abort_key] > aborts_before and m["pagedllm:num_requests_running"] == 0

    wait_until(released, 60, "the abandoned request to be aborted")
