"""POST /v1/messages and /v1/messages/count_tokens as a translation over the chat path.

A Messages request becomes a ChatCompletionRequest (system and content blocks into chat messages,
tool_use / tool_result blocks into tool calls and tool messages, tools and tool_choice, stop_sequences,
sampling), OpenAIServingChat does the work (template, tool parsing or forcing, structured outputs,
sampling, usage), and its response or stream is turned back into a Message or Anthropic's events
(streaming.py). Nothing here renders, samples or parses on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessageParam,
    MessagesRequest,
    MessagesResponse,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    anthropic_id,
    stop_reason,
)
from pagedllm.entrypoints.openai.anthropic.streaming import message_events
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.errors import InputError

logger = logging.getLogger("pagedllm.server")

# Chat fields a Messages request sets itself, under its own name (or not at all): sent at the top level
# they are refused, with the Messages field to use where there is one.
OWN_FIELDS = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "n": None,
    "stream_options": None,
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "logprobs": None,
    "top_logprobs": None,
    "prompt_logprobs": None,
    "add_generation_prompt": None,
    "continue_final_message": None,
    "echo": None,
    "functions": "tools",
    "function_call": "tool_choice",
}


def chat_messages(system: Any, messages: list[MessageParam]) -> list[dict[str, Any]]:
    """Anthropic's system and messages as chat messages: an assistant's tool_use blocks become its
    tool_calls, a user's tool_result blocks tool messages (before the rest of that turn's text, as
    Anthropic puts them first), and thinking passed back is dropped, as Anthropic drops it."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _parts(system)})
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[dict[str, str]] = []
        calls: list[dict[str, Any]] = []
        for block in m.content:
            if block.type == "text":
                texts.append({"type": "text", "text": block.text})
            elif block.type == "tool_use":
                if m.role != "assistant":
                    raise InputError("tool_use blocks belong in assistant messages", param="messages")
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append({"id": block.id, "function": {"name": block.name, "arguments": arguments}})
            elif block.type == "tool_result":
                if m.role != "user":
                    raise InputError("tool_result blocks belong in user messages", param="messages")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        if texts or calls or not m.content:
            out.append({"role": m.role, "content": texts, "tool_calls": calls or None})
    return out


def _parts(system: str | list[Any]) -> str | list[dict[str, str]]:
    return system if isinstance(system, str) else [{"type": "text", "text": b.text} for b in system]


def chat_tools(request: CountTokensRequest) -> dict[str, Any]:
    """tools and tool_choice as the chat request's tools, tool_choice and parallel_tool_calls."""
    fields: dict[str, Any] = {}
    tools = []
    for i, tool in enumerate(request.tools or []):
        if tool.type not in (None, "custom"):
            raise InputError(f"tools.{i}: server tool {tool.type!r} is not supported by this server", "tools")
        if tool.input_schema is None:
            raise InputError(f"tools.{i}.input_schema: Field required", param="tools")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        tools.append({"type": "function", "function": function})
    if tools:
        fields["tools"] = tools
    choice = request.tool_choice
    if choice is None or (not tools and choice.type in ("auto", "none")):  # nothing to choose from: no-op
        return fields
    if choice.type in ("any", "tool") and not tools:
        raise InputError(f"tool_choice {choice.type} needs tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name is None:
            raise InputError("tool_choice.name: Field required for type tool", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def chat_request(request: CountTokensRequest, model: str) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request stands for."""
    request.check_refused()
    body: dict[str, Any] = {
        "model": model,
        "messages": chat_messages(request.system, request.messages),
        **chat_tools(request),
    }
    last = request.messages[-1]
    if last.role == "assistant":  # a prefill: the reply continues it (and does not repeat it)
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    template_kwargs: dict[str, Any] = {}
    if request.thinking is not None:
        # Qwen3-style templates read enable_thinking; others ignore it
        template_kwargs["enable_thinking"] = request.thinking.type != "disabled"
        if request.thinking.budget_tokens is not None and request.thinking.type == "enabled":
            body["max_reasoning_tokens"] = request.thinking.budget_tokens  # needs --reasoning-parser
    if request.output_config is not None and request.output_config.format is not None:
        schema = {"name": "output", "schema": request.output_config.format.json_schema}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(request, MessagesRequest):
        body.update(
            max_tokens=request.max_tokens,
            stop=request.stop_sequences,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stream=request.stream,
            stream_options={"include_usage": True} if request.stream else None,
        )
    for name, value in (request.model_extra or {}).items():
        if name in OWN_FIELDS:
            instead = OWN_FIELDS[name]
            hint = f"; use {instead}" if instead else ""
            raise InputError(f"{name} is not a field of the Messages API{hint}", param=name)
        if name in ChatCompletionRequest.model_fields and name not in body:
            body[name] = value  # an OpenAI / vLLM sampling field sent through extra_body
        else:
            logger.info("ignoring unknown Messages request field: %s", name)
    if template_kwargs:
        body["chat_template_kwargs"] = {**template_kwargs, **(body.get("chat_template_kwargs") or {})}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # a passed-through field out of range
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise InputError(f"{where}: {err.get('msg')}", param=where.split(".")[0] or None) from None


def message_from_chat(
    response: ChatCompletionResponse, stop_sequences: list[str] | None, single_call: bool
) -> MessagesResponse:
    """A chat completion as a Message: thinking (with --reasoning-parser), text, then tool_use blocks."""
    (choice,) = response.choices
    message = choice.message
    content: list[ContentBlock] = []
    if message.reasoning_content:
        content.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        content.append(TextBlock(text=message.content))
    calls = message.tool_calls[:1] if single_call else message.tool_calls
    for call in calls:
        arguments = json.loads(call.function.arguments or "{}")
        content.append(ToolUseBlock(id=anthropic_id("toolu"), name=call.function.name, input=arguments))
    reason = stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences)
    return MessagesResponse(
        model=response.model,
        content=content,
        stop_reason=reason,
        stop_sequence=choice.stop_reason if reason == "stop_sequence" else None,
        usage={
            "input_tokens": response.usage.prompt_tokens,
            "output_tokens": response.usage.completion_tokens,
        },
    )


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_model(request.model)
        return CountTokensResponse(input_tokens=await self._count(chat_request(request, request.model)))

    async def _count(self, chat: ChatCompletionRequest) -> int:
        """The prompt's tokens exactly as the chat path renders them (tools only when offered)."""
        mode = self.chat.tool_mode(chat)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or []] if mode.kind != "none" else None
        tokens = await asyncio.to_thread(
            self.chat.render_messages,
            chat.messages,
            tools,
            add_generation_prompt=chat.add_generation_prompt,
            add_special_tokens=chat.add_special_tokens,
            continue_final_message=chat.continue_final_message,
            **(chat.chat_template_kwargs or {}),
        )
        return len(tokens)

    async def _create(self, chat: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        try:
            return await self.chat.create_chat_completion(chat)
        except InputError as e:  # say the field the client sent
            if e.param != "max_reasoning_tokens":
                raise
            raise InputError(str(e).replace(e.param, "thinking.budget_tokens"), param="thinking") from None

    async def create_message(self, request: MessagesRequest) -> MessagesResponse | AsyncIterator[str]:
        chat = chat_request(request, request.model)
        # disable_parallel_tool_use with auto: the chat path may parse several calls; keep the first
        single_call = not chat.parallel_tool_calls
        if not request.stream:
            response = await self._create(chat)
            assert isinstance(response, ChatCompletionResponse)
            return message_from_chat(response, request.stop_sequences, single_call)
        # message_start carries the prompt's tokens before the chat stream (which gives them at its end)
        num_prompt_tokens = await self._count(chat)
        chunks = await self._create(chat)
        assert not isinstance(chunks, ChatCompletionResponse)
        return message_events(chunks, request.model, num_prompt_tokens, request.stop_sequences, single_call)
