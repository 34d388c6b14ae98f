"""Request and response bodies of OpenAI's Responses API (POST /v1/responses), the subset pagedllm serves.

The request's `input` items and `tools` stay plain dicts here: serving_responses.py converts them to chat
messages and chat tools one by one, so that a bad item is a 400 naming its place (`input[2].type`) and a
built-in tool a 400 naming it. Fields OpenAI defines that pagedllm does not implement are declared and
refused by name when set to anything but "not asked for" (REFUSED); fields no API knows are logged and
ignored, as the chat path does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, OpenAIRequestModel
from pagedllm.errors import InputError

# Fields of OpenAI's Responses request that pagedllm does not implement, and the values that mean "not
# asked for" (None always does): any other value is a 400 naming the field.
RESPONSES_REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "background_options": (),
    "conversation": (),
    "prompt": (),
    # reasoning.encrypted_content asks for reasoning to pass back statelessly: it is nothing to add here,
    # where reasoning passed back is dropped anyway (as chat templates drop earlier turns' reasoning)
    "include": ([], ["reasoning.encrypted_content"]),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "context_management": ([],),
    "moderation": (),
    "prompt_cache_retention": (),
    "prompt_cache_options": (),
    "image": (),
    "access_programs": (),
    "input_transformations": ([],),
}


class TextConfig(OpenAIBaseModel):
    """`text`: format is {"type": "text" | "json_object" | "json_schema", ...} (checked when converted)."""

    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the knob can honour


class ReasoningConfig(OpenAIBaseModel):
    # effort goes to the chat template as `reasoning_effort`, and "none" as `enable_thinking: false` (Qwen3's
    # switch); templates that read neither ignore both. The reasoning item (with --reasoning-parser)
    # carries the whole reasoning text in `content`: summary is accepted, and none is written
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of summary


class ResponsesRequest(OpenAIRequestModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = RESPONSES_REFUSED

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    # vLLM's extra: an output constraint (regex, grammar, choice, json) beyond what text.format can say
    structured_outputs: dict[str, Any] | None = None
    # accepted and unused: ids for abuse monitoring and a cache hint (prefix caching is automatic)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # the refused ones (REFUSED), declared so that they are not taken for unknown fields
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    service_tier: str | None = None
    context_management: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    image: Any = None
    access_programs: Any = None
    input_transformations: Any = None
    stream_options: dict[str, Any] | None = None

    def check_refused(self) -> None:
        for name, harmless in self.REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in harmless:
                raise InputError(f"{name} is not supported by this server", param=name)
        if self.stream_options and self.stream_options.get("include_obfuscation"):
            raise InputError(
                "stream_options.include_obfuscation is not supported by this server", param="stream_options"
            )
        if self.stream_options is not None and not self.stream:
            raise InputError("stream_options requires stream to be true", param="stream_options")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# ---------------------------------------------------------------------------------------------- output items


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Annotated[OutputMessage | FunctionCallItem | ReasoningItem, Field(discriminator="type")]


# ---------------------------------------------------------------------------------------------- response


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(OpenAIBaseModel):
    code: str = "server_error"
    message: str


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
