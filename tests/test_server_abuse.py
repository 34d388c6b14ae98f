"""The real server under inputs and connections a careless or hostile client sends.

Raw HTTP where the official client cannot send the input (NaN, a lone surrogate, a 20 MB body, a stalled
header); the official client elsewhere. Every refusal is a 400 (or 408/413/503) naming the field or the
limit, the server keeps answering /health meanwhile, and the next request succeeds.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server import ServerInfo, assert_good_request, running_server, wait_until

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
MAX_NUM_WAITING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    log = tmp_path_factory.mktemp("abuse") / "server.log"
    with running_server(
        log,
        "--num-kv-blocks", "256", "--max-num-seqs", "4", "--max-model-len", "1024",
        "--timeout-header", str(HEADER_TIMEOUT_S), "--timeout-body", str(BODY_TIMEOUT_S),
        "--max-num-waiting", str(MAX_NUM_WAITING),
    ) as info:  # fmt: skip
        yield info


@pytest.fixture
def client(server: ServerInfo) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url("/v1"), api_key=server.api_key, timeout=120, max_retries=0)
    yield c
    c.close()


def post_raw(server: ServerInfo, path: str, body: str) -> httpx.Response:
    """POST a JSON text as it is (json.dumps would refuse NaN or escape a surrogate differently)."""
    headers = {**server.headers, "Content-Type": "application/json"}
    return httpx.post(server.url(path), content=body.encode(), headers=headers, timeout=60)


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    for word in words:
        assert word in error["message"], error


def health_ok_within(server: ServerInfo, seconds: float) -> bool:
    r = httpx.get(server.url("/health"), timeout=seconds)
    return r.status_code == 200 and r.json() == {"status": "ok"}


# ---------------------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "NaN"),
        ("repetition_penalty", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("presence_penalty", "-Infinity"),
    ],
)
def test_non_finite_numbers_are_400(
    server: ServerInfo, client: openai.OpenAI, field: str, literal: str
) -> None:
    body = f'{{"model": "{server.model}", "prompt": "Hello", "max_tokens": 2, "{field}": {literal}}}'
    assert_400(post_raw(server, "/v1/completions", body), field, "finite")
    assert_good_request(client, server)


def test_out_of_range_integers_and_ids_are_400(server: ServerInfo, client: openai.OpenAI) -> None:
    base = {"model": server.model, "prompt": "Hello", "max_tokens": 2}
    cases = [
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**70)}, "seed"),
        ({"n": 1000}, "n"),
        ({"top_k": 10**9}, "top_k"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"12": 500}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": [5, 10**12]}, "prompt"),
    ]
    for extra, param in cases:
        r = httpx.post(
            server.url("/v1/completions"), json={**base, **extra}, headers=server.headers, timeout=60
        )
        assert_400(r, param)
    # the edges that are allowed still work: a seed at the int64 bound, n at a small value
    ok = client.completions.create(model=server.model, prompt="Hello", max_tokens=2, seed=2**63 - 1, n=2)
    assert len(ok.choices) == 2


def test_lone_surrogate_is_400_not_500(server: ServerInfo, client: openai.OpenAI) -> None:
    prompt = f'{{"model": "{server.model}", "prompt": "abc \\ud800 def", "max_tokens": 2}}'
    assert_400(post_raw(server, "/v1/completions", prompt), "prompt", "UTF-8")
    chat = f'{{"model": "{server.model}", "messages": [{{"role": "user", "content": "hi \\udfff"}}]}}'
    assert_400(post_raw(server, "/v1/chat/completions", chat), "messages", "UTF-8")
    assert_400(post_raw(server, "/tokenize", '{"prompt": "\\ud83d"}'), "prompt", "UTF-8")
    # a proper pair is one character, not an error
    pair = f'{{"model": "{server.model}", "prompt": "\\ud83d\\ude00", "max_tokens": 2}}'
    assert post_raw(server, "/v1/completions", pair).status_code == 200
    assert_good_request(client, server)


def test_unknown_role_is_400(server: ServerInfo, client: openai.OpenAI) -> None:
    r = httpx.post(
        server.url("/v1/chat/completions"),
        json={"model": server.model, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2},
        headers=server.headers,
        timeout=60,
    )
    assert_400(r, "messages", "role")
    # "developer" is OpenAI's newer "system": accepted
    ok = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=2,
    )
    assert ok.choices[0].message.content is not None


# ---------------------------------------------------------------------------------------------- big bodies


def test_20mb_body_is_413_at_once_and_health_answers(server: ServerInfo, client: openai.OpenAI) -> None:
    size = 20 * 2**20
    refused: list[bytes] = []

    def send_big() -> None:
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as s:
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
            )
            s.sendall(head.encode() + b'{"prompt": "' + b"a" * 65536)
            # the answer (and the close) come before the rest of the body is sent
            refused.append(closed_within(s, 30) or b"")

    t = threading.Thread(target=send_big)
    t.start()
    assert health_ok_within(server, 1.0)
    t.join(timeout=30)
    assert refused and refused[0].startswith(b"HTTP/1.1 413"), refused
    assert b"exceeds" in refused[0]

    # a chunked body (no Content-Length) is cut off once it passes the limit
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(size // 2**20):
            yield b"a" * 2**20

    try:
        r = httpx.post(server.url("/v1/completions"), content=chunks(), headers=server.headers, timeout=60)
        assert r.status_code == 413, r.text
    except httpx.WriteError:  # the server closed while we were still sending: also a refusal
        pass
    assert_good_request(client, server)


def test_megabytes_of_text_are_tokenized_off_the_event_loop(
    server: ServerInfo, client: openai.OpenAI
) -> None:
    text = "a" * (4 * 2**20)  # under the 8 MiB limit, far over the context
    results: list[httpx.Response] = []

    def send(path: str, body: dict) -> None:
        results.append(httpx.post(server.url(path), json=body, headers=server.headers, timeout=120))

    threads = [
        threading.Thread(target=send, args=("/v1/completions", {"model": server.model, "prompt": text})),
        threading.Thread(target=send, args=("/tokenize", {"prompt": text})),
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)  # let both bodies arrive and their tokenization start
    while any(t.is_alive() for t in threads):
        assert health_ok_within(server, 1.0)  # raises ReadTimeout if the event loop is blocked
        time.sleep(0.2)
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 400], [r.text[:200] for r in results]
    assert_good_request(client, server)


# ---------------------------------------------------------------------------------------------- connections


def port_of(server: ServerInfo) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open after `seconds`."""
    s.settimeout(seconds)
    received = b""
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return received
            received += data
    except TimeoutError:
        return None
    except ConnectionResetError:
        return received


def test_slowloris_and_silent_connections_are_closed(server: ServerInfo, client: openai.OpenAI) -> None:
    silent = socket.create_connection(("127.0.0.1", port_of(server)))
    slow = socket.create_connection(("127.0.0.1", port_of(server)))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    deadline = time.monotonic() + HEADER_TIMEOUT_S + 10
    sent = 0
    closed = False
    while time.monotonic() < deadline:  # one byte every 0.25 s: never a complete head
        try:
            slow.send(head[sent : sent + 1])
        except OSError:  # the server closed it
            closed = True
            break
        sent += 1
        time.sleep(0.25)
        if closed_within(slow, 0.01) is not None:
            closed = True
            break
    assert closed, "the slow-header connection was still open"
    assert closed_within(silent, 5) is not None, "the silent connection was still open"
    silent.close()
    slow.close()
    assert_good_request(client, server)


def test_stalled_body_is_408(server: ServerInfo, client: openai.OpenAI) -> None:
    with socket.create_connection(("127.0.0.1", port_of(server))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + server.api_key.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt":'
        )
        answer = closed_within(s, BODY_TIMEOUT_S + 10)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert_good_request(client, server)


def test_full_queue_is_503_with_retry_after(server: ServerInfo, client: openai.OpenAI) -> None:
    """A burst of 16 against --max-num-waiting 4: at least 4 are taken (more if a step admitted some to
    the running batch meanwhile), the rest are turned away at once with Retry-After, not queued."""
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    statuses: list[int] = []
    retry_after: list[str | None] = []
    lock = threading.Lock()

    def send() -> None:
        r = httpx.post(server.url("/v1/completions"), json=body, headers=server.headers, timeout=300)
        with lock:
            statuses.append(r.status_code)
            if r.status_code == 503:
                retry_after.append(r.headers.get("retry-after"))
                assert r.json()["error"]["code"] == 503

    threads = [threading.Thread(target=send) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert statuses.count(200) >= MAX_NUM_WAITING, statuses
    assert statuses.count(503) >= 1 and set(statuses) <= {200, 503}, statuses
    assert all(v is not None and int(v) >= 1 for v in retry_after), retry_after
    assert_good_request(client, server)


# ---------------------------------------------------------------------------------------------- the API's description


def test_health_json_metrics_text_and_405_allow(server: ServerInfo) -> None:
    r = httpx.get(server.url("/health"), timeout=10)
    assert r.headers["content-type"].startswith("application/json") and r.json() == {"status": "ok"}
    m = httpx.get(server.url("/metrics"), headers=server.headers, timeout=10)
    assert m.headers["content-type"].startswith("text/plain") and "pagedllm:" in m.text
    wrong = httpx.get(server.url("/v1/completions"), headers=server.headers, timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == 405
    doc = httpx.get(server.url("/openapi.json"), headers=server.headers, timeout=10).json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(completions) and "422" not in completions
    assert "text/plain" in json.dumps(doc["paths"]["/metrics"]["get"]["responses"]["200"])


# ---------------------------------------------------------------------------------------------- shutdown


def test_sigterm_drains_and_exits_0(tmp_path) -> None:
    with running_server(tmp_path / "server.log", "--num-kv-blocks", "64", "--max-model-len", "512") as info:
        assert info.process is not None
        c = openai.OpenAI(base_url=info.url("/v1"), api_key=info.api_key, timeout=120, max_retries=0)
        stream = c.completions.create(
            model=info.model, prompt="Once", max_tokens=24, stream=True, temperature=0
        )
        first = next(iter(stream))  # a request is in flight when the signal comes
        info.process.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert first.choices and rest, "the in-flight stream was cut off"
        assert rest[-1].choices[0].finish_reason == "length"
        wait_until(lambda: info.process.poll() is not None, 60, "the server to exit")
        assert info.process.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]
