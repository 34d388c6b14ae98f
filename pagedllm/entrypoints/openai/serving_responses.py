"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, a thin translation over the
chat path (serving_chat.py), which does the templates, tool calls, structured outputs, sampling and usage.

In: `instructions` becomes a system message and `input` (text, or message / function_call /
function_call_output items) chat messages; `previous_response_id` prepends the stored conversation and its
output; function `tools`, `tool_choice`, `text.format` and `max_output_tokens` become their chat fields.
Out: the chat message becomes output items (a reasoning item when the chat path split one off, a message
with output_text, a function_call per tool call); streamed, the chat deltas become the Responses events,
numbered, in the order the `openai` SDK's stream helper checks. One builder (_ResponseBuilder) makes both,
so a streamed response ends equal to the one returned whole.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pagedllm.entrypoints.openai.responses_store import ResponsesStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.errors import InputError

# The chat field a Responses field becomes, for error messages: the client should read its own names.
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
    "structured_outputs": "structured_outputs",
}
NOT_STORED = "no such stored response (never stored, store false, deleted, or evicted from the store)"
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Server-sent events of a streamed response: `event: <type>` then `data: <the event as JSON>`.
RESPONSES_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
            "required": ["event", "data"],
        }
    }
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------- input


def _field(item: dict[str, Any], key: str, where: str, kind: type = str) -> Any:
    value = item.get(key)
    if not isinstance(value, kind):
        raise InputError(f"{where}.{key} is required and must be a {kind.__name__}", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's or a tool output's content: text, or a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where} must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise InputError(
                f"{where}[{j}]: only text content parts are supported, got {kind!r}", param="input"
            )
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages. Consecutive function_call items join one assistant message (with the
    assistant text before them), as the chat API has them; reasoning items passed back are dropped, as
    chat templates drop earlier turns' reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise InputError(
                    f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", "input"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
            )
        elif kind != "reasoning":
            raise InputError(
                f"{where}.type {kind!r} is not supported by this server (message, function_call, "
                "function_call_output and reasoning items are)",
                param="input",
            )
    return messages


def output_messages(output: list[Any]) -> list[dict[str, Any]]:
    """A stored response's output items as the chat messages a continuation prepends."""
    return input_messages([item.model_dump() for item in output])


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools as the chat API's; any built-in tool (web_search, file_search, ...) is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise InputError(
                f"tools[{i}]: tool type {kind!r} is not supported by this server; only function tools are",
                param="tools",
            )
        fn = {"name": _field(tool, "name", f"tools[{i}]")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> str | dict[str, Any] | None:
    if choice in ("auto", "none") and not tools:  # OpenAI accepts these without tools; the chat path not
        return None
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise InputError(
            f"tool_choice type {choice.get('type')!r} is not supported by this server "
            "(none, auto, required or a function are)",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": _field(choice, "name", "tool_choice")}}


def chat_response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat API's response_format."""
    fmt = fmt or {}
    kind = fmt.get("type", "text")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise InputError(f"text.format.type {kind!r} is not supported by this server", param="text.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InputError("text.format.schema is required and must be an object", param="text.format")
    json_schema = {"name": fmt.get("name") or "response", "schema": schema, "strict": fmt.get("strict")}
    return {"type": "json_schema", "json_schema": json_schema}


def _renamed(e: InputError) -> InputError:
    """A chat-path error in the Responses API's own field names."""
    message = str(e)
    for chat_name, name in CHAT_TO_RESPONSES.items():
        message = message.replace(chat_name, name)
    param = CHAT_TO_RESPONSES.get(e.param or "", e.param)
    if param == "max_output_tokens":  # SamplingParams' own name for it
        message = message.replace("max_tokens", param)
    return InputError(message, param=param)


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice, request.tools),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": chat_response_format(request.text.format if request.text else None),
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "structured_outputs": request.structured_outputs,
    }
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(part) for part in err.get("loc", ())]
        raise _renamed(
            InputError(f"{'.'.join(loc)}: {err.get('msg')}", param=loc[0] if loc else None)
        ) from None


# ---------------------------------------------------------------------------------------------- output


class _ResponseBuilder:
    """Output items from chat deltas (reasoning, text, tool calls), and the stream's events on the way:
    an item is opened (output_item.added, and its content part) when its first delta comes and closed
    (the .done events) when another item starts or the response ends."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.seq = 0
        self.output: list[Any] = []
        self.index: dict[str, int] = {}  # item id -> output_index
        self.open: Any = None
        self.calls: dict[int, FunctionCallItem] = {}  # the chat tool call index -> its item

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _where(self, item: Any, content: bool = True) -> dict[str, Any]:
        where = {"item_id": item.id, "output_index": self.index[item.id]}
        return {**where, "content_index": 0} if content else where

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response.model_dump()
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _add(self, item: Any) -> list[dict[str, Any]]:
        events = self._close()
        self.index[item.id] = len(self.output)
        self.output.append(item)
        self.open = item
        item.status = "in_progress"
        events.append(
            self._event(
                "response.output_item.added", output_index=self.index[item.id], item=item.model_dump()
            )
        )
        if not isinstance(item, FunctionCallItem):
            part = item.content[0].model_dump()
            events.append(self._event("response.content_part.added", **self._where(item), part=part))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        events = []
        if isinstance(item, FunctionCallItem):
            where = self._where(item, content=False)
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=item.arguments)
            )
        else:
            part = item.content[0]
            kind = (
                "response.output_text.done"
                if isinstance(item, OutputMessage)
                else "response.reasoning_text.done"
            )
            extra = {"logprobs": []} if isinstance(item, OutputMessage) else {}
            events.append(self._event(kind, **self._where(item), text=part.text, **extra))
            events.append(
                self._event("response.content_part.done", **self._where(item), part=part.model_dump())
            )
        item.status = status
        events.append(
            self._event("response.output_item.done", output_index=self.index[item.id], item=item.model_dump())
        )
        return events

    def reasoning(self, delta: str | None) -> list[dict[str, Any]]:
        return self._delta(ReasoningItem, "rs", ReasoningText, "response.reasoning_text.delta", delta)

    def text(self, delta: str | None) -> list[dict[str, Any]]:
        return self._delta(OutputMessage, "msg", OutputText, "response.output_text.delta", delta, logprobs=[])

    def _delta(
        self, item_type: type, prefix: str, part_type: type, kind: str, delta: str | None, **extra: Any
    ) -> list[dict[str, Any]]:
        """Text for the open item of item_type (opened first if another kind of item is open)."""
        if not delta:
            return []
        events = []
        if not isinstance(self.open, item_type):
            events = self._add(item_type(id=new_id(prefix), content=[part_type(text="")]))
        self.open.content[0].text += delta
        return [*events, self._event(kind, **self._where(self.open), delta=delta, **extra)]

    def call(
        self, index: int, call_id: str | None, name: str | None, arguments: str | None
    ) -> list[dict[str, Any]]:
        events = []
        if index not in self.calls:
            item = FunctionCallItem(
                id=new_id("fc"), call_id=call_id or new_id("call"), name=name or "", arguments=""
            )
            self.calls[index] = item
            events = self._add(item)
        item = self.calls[index]
        if arguments:
            item.arguments += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    **self._where(item, content=False),
                    delta=arguments,
                )
            )
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Close the last item and complete the response: status incomplete when max_output_tokens (or the
        context) ended it."""
        incomplete = finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        if not self.output:  # nothing came: an empty message, as OpenAI answers an empty completion
            events += self._add(OutputMessage(id=new_id("msg"), content=[OutputText(text="")]))
            events += self._close("incomplete" if incomplete else "completed")
        r = self.response
        r.output = self.output
        r.status = "incomplete" if incomplete else "completed"
        r.incomplete_details = IncompleteDetails() if incomplete else None
        if usage is not None:
            r.usage = ResponseUsage(
                input_tokens=usage["prompt_tokens"],
                output_tokens=usage["completion_tokens"],
                total_tokens=usage["total_tokens"],
            )
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(kind, response=r.model_dump())]

    def fail(self, message: str) -> list[dict[str, Any]]:
        r = self.response
        r.output, r.status, r.error = self.output, "failed", ResponseError(message=message)
        return [self._event("response.failed", response=r.model_dump())]


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore):
        self.chat = chat
        self.store = store

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(f"response {response_id!r}: {NOT_STORED}", status=404, param="response_id")
        return entry.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise APIError(f"response {response_id!r}: {NOT_STORED}", status=404, param="response_id")
        return DeletedResponse(id=response_id)

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | AsyncIterator[str]:
        self.chat.check_model(request.model)
        self.chat.check_fields(request)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            entry = self.store.get(request.previous_response_id)
            if entry is None:
                raise APIError(
                    f"previous_response_id {request.previous_response_id!r}: {NOT_STORED}",
                    status=404,
                    param="previous_response_id",
                )
            history = entry.messages + output_messages(entry.response.output)
        messages = history + input_messages(request.input)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat = chat_request(request, system + messages)
        try:
            result = await self.chat.create_chat_completion(chat)
        except InputError as e:
            raise _renamed(e) from None
        builder = _ResponseBuilder(self._in_progress(request, chat))
        if isinstance(result, AsyncIterator):
            return self._stream(request, builder, result, messages)
        builder.start()
        choice = result.choices[0]
        message = choice.message
        builder.reasoning(getattr(message, "reasoning_content", None))  # set with --reasoning-parser
        builder.text(message.content)
        for i, call in enumerate(message.tool_calls):
            builder.call(i, call.id, call.function.name, call.function.arguments)
        builder.finish(choice.finish_reason, result.usage.model_dump())
        if request.store:
            self.store.put(builder.response, messages)
        return builder.response

    def _in_progress(self, request: ResponsesRequest, chat: ChatCompletionRequest) -> ResponseObject:
        """The response as the request configured it, before any output."""
        tools = [{"type": "function", **t.function.model_dump(exclude_none=True)} for t in chat.tools or []]
        return ResponseObject(
            id=new_id("resp"),
            model=self.chat.model_name,
            status="in_progress",
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning,
            store=request.store,
            temperature=1.0 if request.temperature is None else request.temperature,
            text={"format": (request.text.format if request.text else None) or {"type": "text"}},
            tool_choice=request.tool_choice or "auto",
            tools=tools,
            top_p=1.0 if request.top_p is None else request.top_p,
            user=request.user,
        )

    async def _stream(
        self,
        request: ResponsesRequest,
        builder: _ResponseBuilder,
        chunks: AsyncIterator[str],
        messages: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        """The chat path's chunks (`data: <json>`) as Responses events."""
        finish_reason, usage = None, None
        try:
            for event in builder.start():
                yield sse(event)
            async for chunk in chunks:
                data = chunk.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                body = json.loads(data)
                if "error" in body:  # the engine failed mid-stream: no response.completed, not stored
                    for event in builder.fail(body["error"]["message"]):
                        yield sse(event)
                    return
                usage = body.get("usage") or usage
                for choice in body["choices"]:
                    delta = choice["delta"]
                    events = builder.reasoning(delta.get("reasoning_content")) + builder.text(
                        delta.get("content")
                    )
                    for call in delta.get("tool_calls") or []:
                        fn = call["function"]
                        events += builder.call(
                            call["index"], call.get("id"), fn.get("name"), fn.get("arguments")
                        )
                    for event in events:
                        yield sse(event)
                    finish_reason = choice.get("finish_reason") or finish_reason
            for event in builder.finish(finish_reason, usage):
                yield sse(event)
            if request.store:
                self.store.put(builder.response, messages)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]  # aborts the engine request if we stop early


def add_responses_routes(
    app: FastAPI,
    chat: OpenAIServingChat,
    unless_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    respond: Callable[[Any], Response],
    errors: Callable[..., dict[int | str, dict[str, Any]]],
    store: ResponsesStore | None = None,
) -> None:
    """The routes on `app`. The callables are server.py's: unless_disconnected cancels a generation whose
    client left, respond makes the JSON or event-stream response, errors documents error statuses (this
    module cannot import server.py, which imports it; run as `python -m`, it would even be a second copy)."""
    serving = OpenAIServingResponses(chat, store or ResponsesStore())
    app.state.responses = serving

    @app.post(
        "/v1/responses",
        response_model=ResponseObject,
        responses={200: {"content": RESPONSES_SSE}, **errors(400, 401, 404, 408, 413, 500, 503)},
    )
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API; streamed as `event:` / `data:` server-sent events (no [DONE])."""
        result = await unless_disconnected(raw, serving.create_response(request))
        return result if isinstance(result, Response) else respond(result)

    @app.get("/v1/responses/{response_id}", responses=errors(400, 401, 404, 503))
    async def retrieve_response(response_id: str, stream: bool = False) -> ResponseObject:
        """A stored response (`store: true`, the default); kept in memory, least recently used out first."""
        if stream:
            raise InputError("stream is not supported when retrieving a response", param="stream")
        return serving.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", responses=errors(401, 404, 503))
    async def delete_response(response_id: str) -> DeletedResponse:
        return serving.delete(response_id)
