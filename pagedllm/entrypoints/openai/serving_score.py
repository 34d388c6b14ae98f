"""POST /v1/rerank (also /rerank, /v2/rerank: the Jina / Cohere shape) and /score (vLLM's), and
`add_pooling_routes`, which puts every pooling route on the app.

A cross-encoder scores each (query, document) pair in one forward, its classifier's logit through
CrossEncoder.predict's activation. An embedding model scores a pair by the cosine similarity of the two
embeddings, as vLLM does (engine/pooling_engine.py's score_pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from fastapi import FastAPI

from pagedllm.engine.async_pooling import AsyncPoolingEngine
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, OpenAIServingPooling
from pagedllm.errors import InputError


class OpenAIServingScore(OpenAIServingPooling):
    async def scores(
        self, pairs: list[tuple[str, str]], truncate: int | None, param: str
    ) -> tuple[torch.Tensor, int]:
        """One score per (text_1, text_2) pair, and the tokens read."""
        return await self.pooling_engine(("embed", "score")).score_pairs(pairs, truncate, param)

    async def rerank(self, request: RerankRequest) -> RerankResponse:
        self.check_request(request)
        docs = request.document_texts()
        if not docs:
            raise InputError("documents must not be empty", param="documents")
        scores, tokens = await self.scores(
            [(request.query, d) for d in docs], request.truncate(self.max_model_len), "documents"
        )
        order = sorted(range(len(docs)), key=lambda i: -float(scores[i]))
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=float(scores[i]),
                document=RerankDocument(text=docs[i]) if request.return_documents else None,
            )
            for i in order
        ]
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return RerankResponse(model=request.model or self.model_name, usage=usage, results=results)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        self.check_request(request)
        left = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        right = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        for name, texts in (("text_1", left), ("text_2", right)):
            if not texts:
                raise InputError(f"{name} must not be empty", param=name)
        if len(left) == 1:
            left = left * len(right)
        elif len(left) != len(right):
            raise InputError(
                f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as many as text_2",
                param="text_2",
            )
        scores, tokens = await self.scores(
            list(zip(left, right)), request.truncate(self.max_model_len), "text_2"
        )
        data = [ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)]
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return ScoreResponse(model=request.model or self.model_name, data=data, usage=usage)


def add_pooling_routes(
    app: FastAPI,
    engine: EngineClient,
    pooling: AsyncPoolingEngine | None,
    served_model_names: Sequence[str],
    responses: dict,
) -> None:
    """/v1/embeddings, /v1/rerank (+ /rerank, /v2/rerank), /score (+ /v1/score); app.state.embeddings is
    the OpenAIServingEmbedding other APIs embed through."""
    embeddings = OpenAIServingEmbedding(engine, pooling, served_model_names)
    scores = OpenAIServingScore(engine, pooling, served_model_names)
    app.state.embeddings = embeddings

    @app.post("/v1/embeddings", responses=responses)
    async def create_embedding(request: EmbeddingRequest) -> EmbeddingResponse:
        return await embeddings.create_embedding(request)

    async def rerank(request: RerankRequest) -> RerankResponse:
        return await scores.rerank(request)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, responses=responses, name=f"rerank{path.replace('/', '_')}")(rerank)

    async def score(request: ScoreRequest) -> ScoreResponse:
        return await scores.score(request)

    for path in ("/score", "/v1/score"):
        app.post(path, responses=responses, name=f"score{path.replace('/', '_')}")(score)
