"""Several models behind one server (issue 38 item 1): `--model NAME=PATH` repeated and `--models-dir`, the
models' states in /v1/models, loading on first request, --max-loaded-models (LRU), --idle-unload-s (memory
given back), /metrics and /kv per model. Real servers on loopback, through the openai SDK.

Most models here are tiny random-weight checkpoints (they load in a second); the default GGUF is loaded
once, by the --models-dir server, where its unload must bring the process's RSS down.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from cli_helpers import cli
from test_server import API_KEY, REQUEST_TIMEOUT_S, ServerInfo, read_metrics, running_server, wait_until
from tiny_models import save_tiny_llama

from pagedllm.model.loader import default_model_path

pytestmark = pytest.mark.slow

SMALL = ("--num-kv-blocks", "256", "--max-num-seqs", "8", "--max-model-len", "512")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny_llama(root / name, seed=seed) for name, seed in (("tiny-a", 1), ("tiny-b", 2))}


def client_for(server: ServerInfo) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("/v1"), api_key=API_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )


def statuses(server: ServerInfo) -> dict[str, str]:
    r = httpx.get(server.url("/v1/models"), headers=server.headers, timeout=10)
    r.raise_for_status()
    return {m["id"]: m["status"] for m in r.json()["data"]}


def greedy(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.model == model
    return r.choices[0].text


def greedy_once_loaded(client: openai.OpenAI, server: ServerInfo, model: str) -> str:
    """A model not loaded, with a short --load-timeout-s: 503 with Retry-After, then (loaded) the answer."""
    with pytest.raises(openai.APIStatusError) as e:
        greedy(client, model)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    assert model in e.value.body["message"]
    wait_until(lambda: statuses(server)[model] == "loaded", 120, f"{model} loaded")
    return greedy(client, model)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---------------------------------------------------------------------- --model NAME=PATH, --max-loaded-models


@pytest.fixture(scope="module")
def pair(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    log = tmp_path_factory.mktemp("pair") / "server.log"
    args = ("--model", f"y={tiny['tiny-b']}", "--max-loaded-models", "1", *SMALL)
    with running_server(log, *args, model=f"x={tiny['tiny-a']}") as info:
        yield info


def test_several_models_listed_each_answers_lru(
    pair: ServerInfo, tiny: dict[str, Path], tmp_path: Path
) -> None:
    # the first model is loaded at start-up, the other on its first request
    assert statuses(pair) == {"x": "loaded", "y": "unloaded"}
    card = httpx.get(pair.url("/v1/models/y"), headers=pair.headers, timeout=10).json()
    assert card["root"] == str(tiny["tiny-b"]) and card["status"] == "unloaded"
    with client_for(pair) as c:
        x = greedy(c, "x")
        y = greedy(c, "y")  # loads y; --max-loaded-models 1 unloads x (least recently used, idle)
        assert statuses(pair) == {"x": "unloaded", "y": "loaded"}
        assert greedy(c, "x") == x  # x again: y goes
        assert statuses(pair) == {"x": "loaded", "y": "unloaded"}
        chat = c.chat.completions.create(
            model="y", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "y" and chat.usage.completion_tokens >= 1
    # each answers as a one-model server of the same checkpoint does
    with running_server(tmp_path / "one.log", *SMALL, model=str(tiny["tiny-b"])) as one:
        with client_for(one) as c:
            assert greedy(c, str(tiny["tiny-b"])) == y
    assert x != y  # different weights, different text: the request really reached its own model


def test_unknown_model_is_404(pair: ServerInfo) -> None:
    with client_for(pair) as c:
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["message"] == "The model `nope` does not exist."
    assert e.value.body["param"] == "model"
    r = httpx.get(pair.url("/v1/models/nope"), headers=pair.headers, timeout=10)
    assert r.status_code == 404
    r = httpx.post(pair.url("/api/chat"), json={"model": "nope", "messages": []}, headers=pair.headers)
    assert r.status_code == 404 and "nope" in r.json()["error"]  # Ollama's shape on Ollama's routes


def test_api_key_guards_the_router(pair: ServerInfo) -> None:
    assert httpx.get(pair.url("/v1/models"), timeout=10).status_code == 401
    assert httpx.get(pair.url("/metrics"), timeout=10).status_code == 401


def test_metrics_labelled_by_model(pair: ServerInfo) -> None:
    with client_for(pair) as c:
        greedy(c, "x")
    samples = read_metrics(pair)
    assert samples['pagedllm:model_loaded{model_name="x"}'] == 1.0
    assert samples['pagedllm:model_loaded{model_name="y"}'] == 0.0
    assert samples['pagedllm:kv_cache_blocks_total{model_name="x"}'] == 256.0  # its own KV budget
    assert samples['pagedllm:generation_tokens_total{model_name="x"}'] >= 8


def test_ollama_and_anthropic_routes_pick_the_model(pair: ServerInfo) -> None:
    h = pair.headers
    tags = httpx.get(pair.url("/api/tags"), headers=h, timeout=10).json()
    assert sorted(m["name"] for m in tags["models"]) == ["x:latest", "y:latest"]
    body = {"model": "x:latest", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    r = httpx.post(pair.url("/api/generate"), json=body, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "x:latest"
    ps = httpx.get(pair.url("/api/ps"), headers=h, timeout=10).json()
    assert [m["name"] for m in ps["models"]] == ["x:latest"]  # only the loaded ones
    body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(pair.url("/v1/messages"), json=body, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "x"
    r = httpx.post(pair.url("/v1/messages"), json={**body, "model": "nope"}, headers=h, timeout=10)
    assert r.status_code == 404 and r.json()["type"] == "error"  # Anthropic's shape on its route


def test_kv_page_and_events_pick_the_model(pair: ServerInfo) -> None:
    r = httpx.get(pair.url("/kv?model=x"), headers=pair.headers, timeout=10)
    assert r.status_code == 200 and 'id="model"' in r.text
    r = httpx.get(pair.url("/kv?model=nope"), headers=pair.headers, timeout=10)
    assert r.status_code == 404
    with httpx.stream("GET", pair.url("/kv/events?model=x"), headers=pair.headers, timeout=10) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                assert '"num_blocks"' in line or "blocks" in line
                break


# ---------------------------------------------------------------------- --models-dir, --idle-unload-s


@pytest.fixture(scope="module")
def models_dir(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    (d / "smol.gguf").symlink_to(default_model_path())
    (d / "tiny-a").symlink_to(tiny["tiny-a"], target_is_directory=True)
    (d / "notes.txt").write_text("not a model")
    return d


IDLE_S = 4


def test_models_dir_idle_unload_gives_memory_back(models_dir: Path, tmp_path: Path) -> None:
    # --load-timeout-s 0.05: a request for a model not loaded gets 503 + Retry-After, its load goes on
    args = (
        "--models-dir",
        str(models_dir),
        "--idle-unload-s",
        str(IDLE_S),
        "--load-timeout-s",
        "0.05",
        *SMALL,
    )
    # --model and --models-dir together: the --model ones first (the first is loaded at start-up)
    with running_server(tmp_path / "server.log", *args, model=f"first={default_model_path()}") as server:
        pid = server.process.pid
        loaded_rss = rss_kib(pid)
        # the folder's models named by file name without .gguf and by folder name (notes.txt is no model)
        assert statuses(server) == {"first": "loaded", "smol": "unloaded", "tiny-a": "unloaded"}
        with client_for(server) as c:
            text = greedy_once_loaded(c, server, "tiny-a")
            assert statuses(server)["tiny-a"] == "loaded"
            wait_until(lambda: set(statuses(server).values()) == {"unloaded"}, 4 * IDLE_S + 10, "idle unload")
            unloaded_rss = rss_kib(pid)
            # SmolLM2-135M's weights alone are ~100 MB; the process must have given them back
            assert unloaded_rss < loaded_rss - 60 * 1024, (loaded_rss, unloaded_rss)
            assert greedy_once_loaded(c, server, "tiny-a") == text  # the next request loads it again
            assert statuses(server)["tiny-a"] == "loaded"


# ---------------------------------------------------------------------- refused options


@pytest.mark.parametrize(
    "extra, flag",
    [
        (("--model", "a=default", "--model", "b=default", "--served-model-name", "x"), "--served-model-name"),
        (
            ("--model", "a=default", "--model", "b=default", "--data-parallel-size", "2"),
            "--data-parallel-size",
        ),
        (("--model", "a=default", "--model", "a=default"), "--model"),
        (("--max-loaded-models", "0"), "--max-loaded-models"),
        (("--model", "a=default", "--model", "b=default", "--enable-lora"), "--enable-lora"),
        (("--idle-unload-s", "0"), "--idle-unload-s"),
        (("--models-dir", "/nonexistent"), "--models-dir"),
    ],
)
def test_refused_options_exit_2(capsys: pytest.CaptureFixture, extra: tuple[str, ...], flag: str) -> None:
    # refused before anything starts (no listening, no model), so in-process
    rc, _, err = cli(capsys, "serve", *extra, "--port", "1")
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and flag in lines[0], err
