"""--kv-offload-dir through the real server (issue 38 items 2 and 4): a ~1,700-token prompt, the server
stopped with SIGTERM, a new server on the same directory reports the prompt's tokens as cached
(usage.prompt_tokens_details.cached_tokens, chat and completions; /metrics) and answers the same."""

from __future__ import annotations

import httpx
import pytest
from test_server import API_KEY, read_metrics, running_server

pytestmark = pytest.mark.slow

TEXT = " ".join(
    f"Note {i} on rivers: the quick brown fox jumps over the lazy dog by the river." for i in range(90)
)


def ask(server, kind: str) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 8, "temperature": 0}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": TEXT, "max_tokens": 8, "temperature": 0}
        path = "/v1/completions"
    r = httpx.post(server.url(path), json={"model": server.model, **body}, headers=headers, timeout=300)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return {"text": text, "usage": out["usage"]}


def test_prefix_cache_outlives_the_server(tmp_path):
    args = ("--num-kv-blocks", "256", "--max-model-len", "2048", "--kv-offload-dir", str(tmp_path / "kv"))
    with running_server(tmp_path / "first.log", *args) as server:
        first = {kind: ask(server, kind) for kind in ("chat", "completion")}
        assert first["chat"]["usage"]["prompt_tokens"] >= 1500
        assert first["chat"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        process = server.process
    assert process.returncode == 0  # SIGTERM: drained, wrote its cached blocks, exited cleanly

    with running_server(tmp_path / "second.log", *args) as server:
        for kind in ("chat", "completion"):
            again = ask(server, kind)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1400, kind
            assert again["text"] == first[kind]["text"], kind
        metrics = read_metrics(server)
    assert metrics["pagedllm:external_prefix_cache_hits_total"] >= 2 * 1400
    assert metrics["pagedllm:kv_offload_blocks_read_total"] >= 2 * 1400 // 16
    assert metrics["pagedllm:kv_offload_corrupt_files_total"] == 0
