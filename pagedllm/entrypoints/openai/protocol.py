"""Request and response bodies of the OpenAI-compatible API (the subset pagedllm serves), as pydantic models.

Field names and defaults follow OpenAI's API; vLLM's sampling extras (top_k, min_p, ...) are accepted too.
Unknown fields are ignored, like OpenAI and vLLM do, so newer clients keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- shared


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingRequest(OpenAIBaseModel):
    """Fields completions and chat share, and their translation into SamplingParams."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise InputError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            if not -100 <= bias <= 100:
                raise InputError(f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
            out[token_id] = bias
        return out

    def make_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InputError naming the SamplingParams field that is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self._logit_bias(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingRequest):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None = up to the context length
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # not supported: rejected when set


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- chat


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text; only text content parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InputError(
                    f"only text content parts are supported, got {part.type!r}", param="messages"
                )
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still widely sent
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extra


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str


def dump_sse(chunk: BaseModel | str) -> str:
    """One server-sent event: `data: <json>\n\n`."""
    if isinstance(chunk, BaseModel):
        chunk = chunk.model_dump_json()
    return f"data: {chunk}\n\n"
