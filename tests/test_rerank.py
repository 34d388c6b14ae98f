"""Rerank and score through the real server with a cross-encoder (a random-weight BertForSequenceClassification
with one label, tests/pooling_checkpoints.py), against sentence-transformers' CrossEncoder.predict on the same
folder (its sigmoid activation): /v1/rerank (+ /rerank, /v2/rerank) and /score, scores within 2e-3 and
rerank's order the same; the bad inputs are 400s naming the field, and the server serves on."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from pooling_checkpoints import TEXTS, bert_cross_encoder
from test_embeddings import assert_400, post
from test_server import ServerInfo, running_server

pytestmark = pytest.mark.slow

QUERY = "what is the capital of france"


@pytest.fixture(scope="module")
def cross(tmp_path_factory) -> Iterator[tuple[ServerInfo, object]]:
    path = bert_cross_encoder(tmp_path_factory.mktemp("ce") / "model")
    with running_server(tmp_path_factory.mktemp("log") / "ce.log", "--dtype", "fp32", model=str(path)) as s:
        yield s, path


@pytest.fixture(scope="module")
def reference(cross):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross[1]), device="cpu")


@pytest.fixture(scope="module")
def predicted(reference) -> np.ndarray:
    return reference.predict([(QUERY, d) for d in TEXTS])


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_matches_cross_encoder(cross, predicted, path) -> None:
    server, _ = cross
    r = post(server, path, {"model": server.model, "query": QUERY, "documents": TEXTS})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-predicted, kind="stable"))
    for x in results:
        assert abs(x["relevance_score"] - predicted[x["index"]]) <= 2e-3
        assert x["document"]["text"] == TEXTS[x["index"]]
    assert r.json()["usage"]["total_tokens"] > 0


def test_rerank_top_n_and_documents(cross, predicted) -> None:
    server, _ = cross
    docs = [{"text": t} for t in TEXTS]  # Cohere's document objects
    body = {"model": server.model, "query": QUERY, "documents": docs, "top_n": 3, "return_documents": False}
    r = post(server, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-predicted, kind="stable")[:3])
    assert all(x["document"] is None for x in results)


def test_score_one_to_many_and_pairs(cross, reference, predicted) -> None:
    server, _ = cross
    r = post(server, "/score", {"model": server.model, "text_1": QUERY, "text_2": TEXTS})
    assert r.status_code == 200, r.text
    assert np.allclose([d["score"] for d in r.json()["data"]], predicted, atol=2e-3)
    pairs = list(zip(TEXTS[:3], TEXTS[3:6]))  # N:N, pair by pair
    r = post(server, "/v1/score", {"text_1": TEXTS[:3], "text_2": TEXTS[3:6]})
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == [0, 1, 2]
    assert np.allclose([d["score"] for d in r.json()["data"]], reference.predict(pairs), atol=2e-3)
    r = post(server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]})  # 1:1
    assert r.status_code == 200, r.text
    (only,) = r.json()["data"]
    assert abs(only["score"] - reference.predict([(TEXTS[0], TEXTS[1])])[0]) <= 2e-3


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": " ".join(["the cat"] * 100), "documents": ["a"]}, "documents"),
        ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]}, "text_2"),
        ("/score", {"text_1": [], "text_2": TEXTS}, "text_1"),
        ("/v1/embeddings", {"input": "a cat"}, "model"),  # a cross-encoder does not embed
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ],
)
def test_bad_inputs_are_400s(cross, path, body, param) -> None:
    server, _ = cross
    assert_400(post(server, path, body), param)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_truncated_pair_is_scored(cross) -> None:
    server, _ = cross
    body = {"query": " ".join(["the cat"] * 100), "documents": ["a dog"], "truncate_prompt_tokens": 64}
    r = post(server, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 64


def test_llm_score_offline(cross, predicted) -> None:
    from pagedllm import LLM

    llm = LLM(model=str(cross[1]), dtype="fp32")
    assert np.allclose(llm.score(QUERY, TEXTS), predicted, atol=2e-3)
    with pytest.raises(Exception, match="cross-encoder"):
        llm.embed("a cat")
