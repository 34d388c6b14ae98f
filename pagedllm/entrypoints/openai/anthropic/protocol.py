"""Request and response bodies of Anthropic's Messages API (the subset pagedllm serves), as pydantic models.

Field names and defaults follow https://docs.anthropic.com/en/api/messages. Content blocks pagedllm cannot
take (images, documents, server tools' blocks) and fields it does not implement are refused by name; an
unknown block type is a 400 naming where it is. Fields neither API knows are ignored with one log line,
as on the OpenAI routes; OpenAI / vLLM sampling fields (seed, min_p, ...) that a client sends at the top
level (the `anthropic` SDK's extra_body) go to the chat path, which checks them as it does its own.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIRequestModel
from pagedllm.errors import InputError

# Block types a request may hold, and the ones Anthropic defines that pagedllm does not take.
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
UNSUPPORTED_BLOCK_TYPES = frozenset(
    {
        "image",
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "container_upload",
        "mcp_tool_use",
        "mcp_tool_result",
    }
)

# Anthropic's error type per HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------- errors


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body (it has no `param`: the message names the field)."""
    err_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=err_type, message=message)).model_dump()


# ---------------------------------------------------------------------------------------------- request


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")
    cache_control: dict[str, Any] | None = None  # a hint: prefix caching is automatic here


class TextBlockParam(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None  # accepted and not used


class ToolUseBlockParam(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] = ""
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlockParam(_Block):
    """An earlier turn's thinking, passed back: not part of the prompt (as on Anthropic's API)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(BaseModel):
    """A client tool (type custom). Anthropic allows 128-character names; the chat path takes 64."""

    model_config = ConfigDict(extra="ignore")
    type: str | None = None  # "custom", or a server tool's versioned type (refused)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced when a call is forced, strict or not
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool to call
    disable_parallel_tool_use: bool = False


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class JSONOutputFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: JSONOutputFormat | None = None
    effort: str | None = None  # refused when set


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    user_id: str | None = None  # accepted and ignored


def _check_blocks(data: Any) -> None:
    """Unknown or unsupported block types, as one clear 400 each, before pydantic's union errors."""
    if not isinstance(data, dict):
        return

    def check(blocks: Any, where: str, allowed: tuple[str, ...]) -> None:
        if not isinstance(blocks, list):
            return
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.{j}"
            if kind in UNSUPPORTED_BLOCK_TYPES:
                raise InputError(f"{at}: {kind} blocks are not supported by this server", param=where)
            if kind not in allowed:
                raise InputError(
                    f"{at}: unknown content block type {kind!r}; expected one of {', '.join(allowed)}",
                    param=where.split(".")[0],
                )
            if kind == "tool_result":
                check(block.get("content"), f"{at}.content", ("text",))

    check(data.get("system"), "system", ("text",))
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            allowed = ("text",) if message.get("role") == "system" else BLOCK_TYPES
            check(message.get("content"), f"messages.{i}.content", allowed)


class CountTokensRequest(OpenAIRequestModel):
    """POST /v1/messages/count_tokens: what a prompt is made of, without generation settings."""

    # unknown fields are kept (model_extra): logged, or passed to the chat path when they are its sampling
    # fields (MessagesRequest)
    model_config = ConfigDict(extra="allow")
    # Anthropic's fields pagedllm does not implement, and the values that mean "not asked for" (None always
    # does): any other value is a 400 naming the field.
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "container": (),
        "mcp_servers": ((), []),
        "context_management": (),
        "speed": ("standard",),
    }

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # declared so that they are not taken for unknown fields
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    speed: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        _check_blocks(data)
        return data

    def check_refused(self) -> None:
        for name, harmless in self.REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and value not in harmless:
                raise InputError(f"{name} is not supported by this server", param=name)
        if self.output_config is not None and self.output_config.effort is not None:
            raise InputError("output_config.effort is not supported by this server", param="output_config")


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either is served
    inference_geo: str | None = None  # accepted: the model runs where this server does


# ---------------------------------------------------------------------------------------------- response


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing to verify: pagedllm does not check thinking passed back


ContentBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None) -> StopReason:
    """The chat path's finish_reason and stop_reason (the stop string that matched) as Anthropic's."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls":
        return "tool_use"
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence"
    return "end_turn"


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str = Field(default_factory=lambda: anthropic_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
