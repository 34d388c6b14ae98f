"""Embeddings through the real server (`python -m pagedllm.entrypoints.openai.server --model FOLDER`) and the
official `openai` client, against sentence-transformers' own `encode` on the same folder: a BERT with mean
pooling + Normalize saved by sentence-transformers 6, an XLM-R with CLS pooling in the hub's layout, and a
Qwen3 with last-token pooling (tests/pooling_checkpoints.py writes them, random weights, float32).

Equal means cosine >= 0.9999 and max abs difference <= 2e-3, row by row.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from fake_engine import FakeEngine, serve_in_thread
from pooling_checkpoints import TEXTS, bert_mean_st, qwen3_lasttoken_st, xlmr_cls_hub_layout
from test_server import ServerInfo, running_server

from pagedllm.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.slow


def st_encode(path, texts, truncate_dim=None) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return torch.tensor(model.encode(texts, truncate_dim=truncate_dim))


def assert_same(ours, ref) -> None:
    ours, ref = torch.as_tensor(np.asarray(ours), dtype=torch.float32), ref.float()
    assert ours.shape == ref.shape
    assert F.cosine_similarity(ours, ref, dim=-1).min() >= 0.9999
    assert (ours - ref).abs().max() <= 2e-3


def client_of(server: ServerInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=server.api_key, max_retries=0, timeout=60)


def post(server: ServerInfo, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=server.headers, timeout=60)


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Iterator[tuple[ServerInfo, object]]:
    path = bert_mean_st(tmp_path_factory.mktemp("bert") / "st")
    log = tmp_path_factory.mktemp("log") / "bert.log"
    with running_server(log, "--dtype", "fp32", model=str(path)) as server:
        yield server, path


@pytest.fixture(scope="module")
def bert_ref(bert) -> torch.Tensor:
    return st_encode(bert[1], TEXTS)


def test_float_single_and_batch(bert, bert_ref) -> None:
    server, _ = bert
    client = client_of(server)
    one = client.embeddings.create(model=server.model, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and one.data[0].index == 0
    assert_same([one.data[0].embedding], bert_ref[:1])
    batch = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert_same([d.embedding for d in batch.data], bert_ref)
    # normalized, as the folder's Normalize module does
    assert np.allclose(np.linalg.norm([d.embedding for d in batch.data], axis=1), 1, atol=1e-5)


def test_usage_counts_the_tokens(bert) -> None:
    server, path = bert
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    r = client_of(server).embeddings.create(model=server.model, input=TEXTS[:3])
    n = sum(len(tok(t)["input_ids"]) for t in TEXTS[:3])
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n


def test_base64(bert, bert_ref) -> None:
    server, _ = bert
    client = client_of(server)
    raw = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="base64")
    rows = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    assert_same(rows, bert_ref)
    # without encoding_format the client asks for base64 itself and decodes it to floats
    default = client.embeddings.create(model=server.model, input=TEXTS[:2])
    assert_same([d.embedding for d in default.data], bert_ref[:2])


def test_token_ids(bert, bert_ref) -> None:
    server, path = bert
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    client = client_of(server)
    one = client.embeddings.create(model=server.model, input=ids[1], encoding_format="float")
    assert_same([one.data[0].embedding], bert_ref[1:2])
    many = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    assert_same([d.embedding for d in many.data], bert_ref)


def test_dimensions(bert) -> None:
    server, path = bert
    r = client_of(server).embeddings.create(
        model=server.model, input=TEXTS, dimensions=32, encoding_format="float"
    )
    # sentence-transformers truncates after its Normalize; the server renormalizes (vLLM's rule)
    ref = F.normalize(st_encode(path, TEXTS, truncate_dim=32), dim=-1)
    assert_same([d.embedding for d in r.data], ref)


def test_langchain_openai_embeddings(bert, bert_ref) -> None:
    from langchain_openai import OpenAIEmbeddings

    server, _ = bert
    emb = OpenAIEmbeddings(
        model=server.model,
        base_url=server.url("/v1"),
        api_key=server.api_key,
        check_embedding_ctx_length=False,  # send text: the tiktoken ids it would send are OpenAI's vocabulary
        max_retries=0,
    )
    assert_same(emb.embed_documents(TEXTS), bert_ref)
    assert_same([emb.embed_query(TEXTS[2])], bert_ref[2:3])


def test_ollama_embed_and_embeddings(bert, bert_ref) -> None:
    """Ollama's /api/embed (and the older /api/embeddings) through the official ollama client."""
    import ollama

    server, _ = bert
    name = client_of(server).models.list().data[0].id
    client = ollama.Client(host=server.base_url, headers=server.headers, timeout=60)
    r = client.embed(model=name, input=TEXTS)
    assert_same(r.embeddings, bert_ref)
    assert r.prompt_eval_count > len(TEXTS) and r.total_duration > 0
    assert_same([client.embeddings(model=f"{name}:latest", prompt=TEXTS[1]).embedding], bert_ref[1:2])
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nope", input="x")
    assert e.value.status_code == 404
    r = httpx.post(server.url("/api/embed"), json={"model": name, "input": []}, headers=server.headers)
    assert r.status_code == 400 and list(r.json()) == ["error"], r.text
    body = {"model": name, "input": "x", "options": {"temperature": 0}}  # refused, never ignored
    r = httpx.post(server.url("/api/embed"), json=body, headers=server.headers)
    assert r.status_code == 400 and "options" in r.json()["error"], r.text


def test_score_and_rerank_by_cosine(bert, bert_ref) -> None:
    server, _ = bert
    r = post(server, "/score", {"model": server.model, "text_1": TEXTS[0], "text_2": TEXTS[1:4]})
    assert r.status_code == 200, r.text
    cos = F.cosine_similarity(bert_ref[:1], bert_ref[1:4], dim=-1)
    assert np.allclose([d["score"] for d in r.json()["data"]], cos, atol=2e-3)
    r = post(server, "/v1/rerank", {"model": server.model, "query": TEXTS[0], "documents": TEXTS[1:4]})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == cos.argsort(descending=True).tolist()


def test_truncate_prompt_tokens(bert) -> None:
    server, path = bert
    long_text = " ".join(["the cat runs fast"] * 60)  # 240 words: over the folder's 128 tokens
    r = post(server, "/v1/embeddings", {"model": server.model, "input": long_text})
    assert_400(r, "input")
    assert "truncate_prompt_tokens" in r.json()["error"]["message"]
    r = post(
        server, "/v1/embeddings", {"model": server.model, "input": long_text, "truncate_prompt_tokens": 20}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok(long_text, truncation=True, max_length=20)["input_ids"]
    ref = st_encode(path, [tok.decode(ids, skip_special_tokens=True)])
    assert_same([r.json()["data"][0]["embedding"]], ref)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[5, 10**6]]}, "input"),  # outside the vocabulary
        ({"input": ["a", 1]}, "input"),
        ({"input": "a cat", "dimensions": 100}, "dimensions"),  # above the model's 64
        ({"input": "a cat", "dimensions": 20}, "dimensions"),  # not one of its Matryoshka sizes
        ({"input": "a cat", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a cat", "add_special_tokens": False}, "add_special_tokens"),
        ({"input": "a cat", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_inputs_are_400s(bert, body, param) -> None:
    server, _ = bert
    assert_400(post(server, "/v1/embeddings", {"model": server.model, **body}), param)


def test_generation_is_refused_and_the_server_serves_on(bert) -> None:
    server, _ = bert
    client = client_of(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model"
    assert_400(post(server, "/v1/completions", {"model": server.model, "prompt": "hi"}), "model")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a cat")
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert len(client.embeddings.create(model=server.model, input="a cat").data) == 1


def test_llm_embed_offline(bert, bert_ref) -> None:
    from pagedllm import LLM

    llm = LLM(model=str(bert[1]), dtype="fp32")
    assert_same(llm.embed(TEXTS), bert_ref)
    assert_same(llm.embed(TEXTS[3]), bert_ref[3:4])
    with pytest.raises(Exception, match="generative|embedding"):
        llm.generate("hi")


def test_xlmr_cls_hub_layout(tmp_path_factory) -> None:
    path = xlmr_cls_hub_layout(tmp_path_factory.mktemp("xlmr") / "st")
    ref = st_encode(path, TEXTS)
    with running_server(tmp_path_factory.mktemp("log") / "xlmr.log", "--dtype", "fp32", model=str(path)) as s:
        client = client_of(s)
        one = client.embeddings.create(model=s.model, input=TEXTS[4], encoding_format="float")
        assert_same([one.data[0].embedding], ref[4:5])
        batch = client.embeddings.create(model=s.model, input=TEXTS, encoding_format="float")
        assert_same([d.embedding for d in batch.data], ref)
        # no Normalize module: the raw CLS vectors
        assert not np.allclose(np.linalg.norm([d.embedding for d in batch.data], axis=1), 1, atol=1e-3)
        # no Matryoshka declaration: dimensions is refused
        assert_400(
            post(s, "/v1/embeddings", {"model": s.model, "input": "a", "dimensions": 16}), "dimensions"
        )
        assert httpx.get(s.url("/health"), timeout=10).status_code == 200


def test_qwen3_last_token(tmp_path_factory) -> None:
    path = qwen3_lasttoken_st(tmp_path_factory.mktemp("qwen3") / "st")
    ref = st_encode(path, TEXTS)
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(str(path))(t)["input_ids"] for t in TEXTS]
    with running_server(
        tmp_path_factory.mktemp("log") / "qwen3.log", "--dtype", "fp32", model=str(path)
    ) as s:
        client = client_of(s)
        batch = client.embeddings.create(model=s.model, input=TEXTS, encoding_format="float")
        assert_same([d.embedding for d in batch.data], ref)
        by_ids = client.embeddings.create(model=s.model, input=ids[:3], encoding_format="float")
        assert_same([d.embedding for d in by_ids.data], ref[:3])


def test_embeddings_on_a_generative_server_are_refused() -> None:
    engine = AsyncEngine(FakeEngine(step_delay=0.001))
    with serve_in_thread(engine) as (base_url, _):
        r = httpx.post(base_url + "/v1/embeddings", json={"model": "fake", "input": "a cat"}, timeout=30)
        assert_400(r, "model")
        r = httpx.post(base_url + "/v1/rerank", json={"query": "a", "documents": ["b"]}, timeout=30)
        assert_400(r, "model")
        assert httpx.get(base_url + "/health", timeout=10).status_code == 200


def test_bench_embed_prints_both_systems(bert, capsys, tmp_path) -> None:
    from cli_helpers import cli

    report = tmp_path / "embed.json"
    rc, out, _ = cli(
        capsys, "bench", "embed", "--model", str(bert[1]), "--num-texts", "6", "--min-len", "8",
        "--max-len", "40", "--dtype", "fp32", "--output-json", str(report),
    )  # fmt: skip
    assert rc == 0 and "sentence-transformers" in out and "pagedllm" in out
    rows = json.loads(report.read_text())["results"]
    assert [r["system"] for r in rows] == ["pagedllm", "sentence-transformers"]
    assert rows[1]["min_cosine_to_pagedllm"] >= 0.9999
    assert all(r["seqs_per_s"] > 0 for r in rows)
