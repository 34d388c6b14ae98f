"""Multi-LoRA serving through the real server on loopback and the openai SDK (issue 37 item 3): adapters
picked by `model`, listed with their parent, equal to transformers + peft greedy; runtime load, use,
unload, then a 404 naming it; bad folders refused by name while the server serves on; /metrics' gauge."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_lora import MAX_TOKENS, PROMPTS, folders, references  # noqa: F401 - fixtures: adapters, peft's tokens
from test_server import API_KEY, REQUEST_TIMEOUT_S, read_metrics, running_server
from tiny_models import default_hf_tokenizer


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):  # noqa: F811
    root, base, a1, _ = folders
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    with running_server(
        log,
        "--dtype", "fp32", "--num-kv-blocks", "128", "--served-model-name", "base",
        "--enable-lora", "--lora-modules", f"a1={a1}", "--max-loras", "2", "--max-lora-rank", "8",
        "--allow-runtime-lora-updating",
        model=str(base),
    ) as info:  # fmt: skip
        yield info


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, timeout=REQUEST_TIMEOUT_S)


def greedy(c: openai.OpenAI, model: str, prompt: list[int]) -> str:
    r = c.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


@pytest.fixture(scope="module")
def texts(references):  # noqa: F811
    """peft's greedy tokens as the server's text (the same tokenizer, special tokens skipped)."""
    tok = default_hf_tokenizer()
    return {key: tok.decode(ids, skip_special_tokens=True) for key, ids in references.items()}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=server.headers, timeout=30)


def test_adapters_listed_picked_by_model_and_equal_to_peft(server, texts):
    c = client(server)
    cards = {m.id: m for m in c.models.list().data}
    assert set(cards) == {"base", "a1"}
    assert cards["a1"].parent == "base" and getattr(cards["base"], "parent", None) is None
    assert greedy(c, "a1", PROMPTS[0]) == texts[("a1", 0)]
    assert greedy(c, "base", PROMPTS[0]) == texts[("base", 0)]
    assert texts[("a1", 0)] != texts[("base", 0)]


def test_runtime_load_use_unload_then_404(server, folders, texts):  # noqa: F811
    _, _, _, a2 = folders
    c = client(server)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(a2)})
    assert r.status_code == 200, r.text
    assert "a2" in {m.id for m in c.models.list().data}
    # 12 concurrent requests mixing both adapters and the base, each equal to its own reference
    jobs = [(("base", "a1", "a2")[i % 3], i % 2) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda job: greedy(c, job[0], PROMPTS[job[1]]), jobs))
    assert got == [texts[job] for job in jobs]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        greedy(c, "a2", PROMPTS[0])
    assert "a2" in str(e.value) and e.value.body["param"] == "model"
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 404 and "a2" in r.json()["error"]["message"]


def test_bad_folders_refused_by_name_and_server_serves_on(server, folders, tmp_path, texts):  # noqa: F811
    _, _, a1, _ = folders
    no_weights = shutil.copytree(a1, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    for path, what in ((tmp_path / "nowhere", "does not exist"), (no_weights, "adapter_model.safetensors")):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400 and what in r.json()["error"]["message"], r.text
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a1)})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="nope"):
        greedy(client(server), "nope", PROMPTS[0])
    assert "bad" not in {m.id for m in client(server).models.list().data}
    assert greedy(client(server), "a1", PROMPTS[1]) == texts[("a1", 1)]


def test_metrics_lora_requests_info(server):
    samples = read_metrics(server)
    info = [name for name in samples if name.startswith("pagedllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
