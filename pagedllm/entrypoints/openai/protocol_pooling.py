"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, the Jina / Cohere / vLLM
rerank (/v1/rerank, /rerank, /v2/rerank) and vLLM's /score.

Fields as those APIs name them; vLLM's extras (truncate_prompt_tokens) are implemented. A field another
of these APIs defines that pagedllm does not implement is refused by name (REFUSED) when set to anything
but its harmless default; fields no API knows are ignored, as the generative routes do.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import OpenAIRequestModel, random_id
from pagedllm.entrypoints.openai.protocol import now as unix_now
from pagedllm.errors import InputError


class PoolingRequest(OpenAIRequestModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extras kept, to refuse or log them
    # field -> the values that mean "not used" (anything else is refused, naming the field)
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "add_special_tokens": (None, True),
        "priority": (None, 0),
        "mm_processor_kwargs": (None, {}),
        "embed_dtype": (None, "float32"),
    }
    model: str | None = None
    # vLLM: keep at most this many tokens of each input (-1: the model's maximum)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    def check_refused(self) -> None:
        extra = self.model_extra or {}
        for name, harmless in self.REFUSED.items():
            if name in extra and extra[name] not in harmless:
                raise InputError(f"{name} is not supported by pagedllm", param=name)

    def truncate(self, max_model_len: int) -> int | None:
        if self.truncate_prompt_tokens == 0:
            raise InputError(
                "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
            )
        return max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens


class EmbeddingRequest(PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class PoolingListResponse(BaseModel):
    """OpenAI's list envelope, which /v1/embeddings and vLLM's /score share."""

    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    usage: PoolingUsage


class EmbeddingResponse(PoolingListResponse):
    data: list[EmbeddingData]


class RerankDocument(BaseModel):
    text: str


class RerankRequest(PoolingRequest):
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class ScoreRequest(PoolingRequest):
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(PoolingListResponse):
    id: str = Field(default_factory=lambda: random_id("score"))
    data: list[ScoreData]
