"""POST /v1/embeddings (OpenAI's shape; vLLM's truncate_prompt_tokens); serving_score.py's
`add_pooling_routes` puts it on the app beside rerank and score.

`app.state.embeddings` is the OpenAIServingEmbedding; other APIs embed through its `embed` method (Ollama's
/api/embed), which takes what OpenAI's `input` takes and answers float32 vectors and the prompt tokens, or
raises InputError naming the field (the caller's API renders it in its own error shape).

A generative server has these routes too: they answer 400 naming `model`, as the generative routes do on a
pooling server (refuse_generation).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.engine.async_pooling import AsyncPoolingEngine
from pagedllm.engine.pooling_engine import PoolingInput
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai import OpenAIServing, logger
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingUsage,
)
from pagedllm.errors import InputError
from pagedllm.model.pooling import truncate_dimensions

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


@dataclass
class Embeddings:
    vectors: torch.Tensor  # [N, dimensions] float32, one row per input, in input order
    prompt_tokens: int  # the inputs' tokens (after truncation)


def refuse_generation(pooling: AsyncPoolingEngine | None) -> None:
    """A generative route on a pooling server: 400 naming `model`."""
    if pooling is not None:
        raise InputError(
            "this server's model is an embedding / scoring model; use /v1/embeddings, /v1/rerank or /score",
            param="model",
        )


class OpenAIServingPooling(OpenAIServing):
    """What the pooling routes share: the pooling engine (None on a generative server) and request checks."""

    def __init__(
        self, engine: EngineClient, pooling: AsyncPoolingEngine | None, served_model_names: Sequence[str]
    ):
        super().__init__(engine, served_model_names)
        self.pooling = pooling

    def pooling_engine(self, tasks: tuple[str, ...] = ("embed",)) -> AsyncPoolingEngine:
        if self.pooling is None:
            raise InputError(
                f"the model `{self.model_name}` is a generative model; serve an embedding or scoring model "
                "(or a decoder with --runner pooling) for this route",
                param="model",
            )
        if self.pooling.task not in tasks:
            raise InputError(
                f"the model `{self.model_name}` is a cross-encoder (it scores pairs): use /v1/rerank or /score",
                param="model",
            )
        return self.pooling

    def check_request(self, request: PoolingRequest) -> None:
        self.check_model(request.model)
        request.check_refused()
        unknown = sorted(set(request.model_extra or {}) - set(request.REFUSED))
        if unknown:
            logger.info("ignoring unknown request fields: %s", ", ".join(unknown))

    async def tokenized(self, inputs: EmbeddingInput, truncate: int | None, param: str) -> list[PoolingInput]:
        """OpenAI's `input` forms as token ids: a string, strings, token ids, lists of token ids."""
        pooling = self.pooling_engine(("embed", "score"))
        if isinstance(inputs, str):
            inputs = [inputs]
        if not inputs:
            raise InputError(f"{param} must not be empty", param=param)
        if all(isinstance(x, str) for x in inputs):
            return await pooling.tokenize(list(inputs), truncate, param)
        if all(isinstance(x, int) for x in inputs):
            inputs = [inputs]
        if not all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in inputs):
            raise InputError(f"{param} must be a string, strings, token ids or lists of token ids", param)
        return pooling.check([PoolingInput(list(ids)) for ids in inputs], truncate, param)


class OpenAIServingEmbedding(OpenAIServingPooling):
    async def embed(
        self,
        inputs: EmbeddingInput,
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        param: str = "input",
    ) -> Embeddings:
        """The embeddings of `inputs` (a string, strings, token ids or lists of them): the API other
        routes call. truncate_prompt_tokens: keep at most that many tokens of each input (else an input
        over the model's length is refused); dimensions: Matryoshka, the first that many values
        (renormalized where the model normalizes). InputError naming `param` (or the option) when bad."""
        pooling = self.pooling_engine()
        if dimensions is not None:
            self._check_dimensions(pooling, dimensions)
        items = await self.tokenized(inputs, truncate_prompt_tokens, param)
        vectors = await pooling.embed(items)
        if dimensions is not None:
            vectors = truncate_dimensions(vectors, dimensions, pooling.normalizes)
        return Embeddings(vectors, sum(len(i.token_ids) for i in items))

    @staticmethod
    def _check_dimensions(pooling: AsyncPoolingEngine, dimensions: int) -> None:
        allowed = pooling.matryoshka_dimensions
        if allowed is None:
            raise InputError(
                "this model does not support Matryoshka embeddings: leave dimensions unset",
                param="dimensions",
            )
        if not 1 <= dimensions <= pooling.hidden_size:
            raise InputError(
                f"dimensions must be between 1 and the model's {pooling.hidden_size}, got {dimensions}",
                param="dimensions",
            )
        if allowed and dimensions not in allowed:
            raise InputError(
                f"dimensions {dimensions} is not one this model was trained for ({list(allowed)})",
                param="dimensions",
            )

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.check_request(request)
        truncate = request.truncate(self.max_model_len)
        result = await self.embed(
            request.input, truncate_prompt_tokens=truncate, dimensions=request.dimensions
        )
        data = [
            EmbeddingData(index=i, embedding=_encode(row, request.encoding_format))
            for i, row in enumerate(result.vectors)
        ]
        usage = PoolingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
        return EmbeddingResponse(model=request.model or self.model_name, data=data, usage=usage)


def _encode(row: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii")
    return row.tolist()
