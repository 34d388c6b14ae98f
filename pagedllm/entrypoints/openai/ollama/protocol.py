"""Ollama's request and response bodies (the subset pagedllm serves), named as in Ollama's api/types.go.

Requests keep unknown top-level fields (logged, as Ollama's JSON decoding ignores them); a field Ollama
defines that pagedllm does not implement is refused by name (serving.py). Responses are dumped without
their None fields, as Ollama's `omitempty` does.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.entrypoints.openai.protocol import OpenAIRequestModel

# Ollama's "think": a bool, or a level for the models that take one (gpt-oss)
ThinkValue = bool | Literal["high", "medium", "low"]
# Ollama's "format": "" (none), "json" (any JSON), or a JSON schema
FormatValue = Literal["", "json"] | dict[str, Any]


def created_at() -> str:
    """RFC 3339 in UTC with fractional seconds, as Ollama writes Go's time.Time."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now_ns() -> int:
    return time.perf_counter_ns()


class OllamaRequest(OpenAIRequestModel):
    """UTF-8 text and no NaN / infinity anywhere (OpenAIRequestModel); unknown fields kept to be logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# ---------------------------------------------------------------------------------------------- chat


class OllamaToolCallFunction(BaseModel):
    index: int | None = None  # the call's place among the turn's calls (Ollama >= 0.12 writes it)
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not JSON text as in OpenAI's API


class OllamaToolCall(BaseModel):
    function: OllamaToolCallFunction


class OllamaMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an assistant's earlier reasoning (templates drop it, as Ollama's do)
    images: list[str] | None = None  # base64 images: refused, no model here takes images
    tool_calls: list[OllamaToolCall] | None = None  # an assistant's earlier calls
    tool_name: str | None = None  # a tool message: the function whose result it is

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, role: Any) -> Any:
        return role.lower() if isinstance(role, str) else role  # Ollama lowercases roles


class OllamaTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: dict[str, Any]  # name, description, parameters (a JSON schema); checked by the chat path


class OllamaChatRequest(OllamaRequest):
    model: str
    messages: list[OllamaMessage] = Field(
        default_factory=list
    )  # none: the model is loaded (done_reason "load")
    tools: list[OllamaTool] | None = None
    format: FormatValue | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None
    think: ThinkValue | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None


class OllamaTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class OllamaLogprob(OllamaTokenLogprob):
    """One generated token's log-probability and, with top_logprobs, the most likely tokens there."""

    top_logprobs: list[OllamaTokenLogprob] | None = None


class OllamaMetrics(BaseModel):
    """Ollama's timings, all in nanoseconds, and token counts; on the last (done) chunk only. logprobs: the
    chunk's tokens' (with logprobs true)."""

    logprobs: list[OllamaLogprob] | None = None

    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatResponse(OllamaMetrics):
    model: str
    created_at: str = Field(default_factory=created_at)
    message: OllamaResponseMessage
    done: bool
    done_reason: str | None = None  # stop | length | load


# ---------------------------------------------------------------------------------------------- generate


class OllamaGenerateRequest(OllamaRequest):
    model: str
    prompt: str = ""  # empty: the model is loaded (done_reason "load")
    suffix: str = ""
    system: str = ""
    template: str = ""
    context: list[int] | None = None  # the token ids an earlier response returned, to continue from
    stream: bool = True
    raw: bool = False  # the prompt as it is, without the chat template
    format: FormatValue | None = None
    keep_alive: float | str | None = None
    images: list[str] | None = None
    options: dict[str, Any] | None = None
    think: ThinkValue | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # image generation (Ollama's experimental image models): refused
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class OllamaGenerateResponse(OllamaMetrics):
    model: str
    created_at: str = Field(default_factory=created_at)
    response: str
    done: bool
    done_reason: str | None = None
    context: list[int] | None = None  # prompt and response token ids, on the done chunk


# ---------------------------------------------------------------------------------------------- models


class OllamaShowRequest(OllamaRequest):
    model: str | None = None
    name: str | None = None  # what older clients send instead of model
    verbose: bool = False


class OllamaModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaListModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaListResponse(BaseModel):
    models: list[OllamaListModel]


class OllamaShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaProcessModel(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: OllamaModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class OllamaProcessResponse(BaseModel):
    models: list[OllamaProcessModel]


class OllamaVersionResponse(BaseModel):
    version: str


class OllamaError(BaseModel):
    """Every Ollama error: {"error": "..."} with the HTTP status saying which kind."""

    error: str


# ---------------------------------------------------------------------------------------------- embed


class OllamaEmbedRequest(OllamaRequest):
    model: str
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True  # Ollama's default: an input over the context is cut to it (false: a 400)
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int  # nanoseconds, as Ollama's other timings
    load_duration: int = 0  # the model was loaded at start-up
    prompt_eval_count: int


class OllamaEmbeddingsRequest(OllamaRequest):
    """The older /api/embeddings: one prompt, one vector, no truncation field (Ollama truncates)."""

    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbeddingsResponse(BaseModel):
    embedding: list[float]
