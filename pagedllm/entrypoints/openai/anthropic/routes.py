"""POST /v1/messages and POST /v1/messages/count_tokens on the server's app; errors under /v1/messages
in Anthropic's shape (errors.add_error_shape)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    error_body,
)
from pagedllm.entrypoints.openai.anthropic.serving import AnthropicServingMessages
from pagedllm.entrypoints.openai.errors import add_error_shape
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

PREFIX = "/v1/messages"
_ERRORS = {
    400: "invalid_request_error: the request is malformed; the message names the field",
    401: "authentication_error: missing or wrong API key (x-api-key or Authorization: Bearer)",
    404: "not_found_error: no such model",
    408: "invalid_request_error: the request body stalled",
    413: "request_too_large: the request body is over --max-request-body",
    500: "api_error: the request failed inside the engine",
    503: "overloaded_error: the server is shutting down or the queue is full (see Retry-After)",
}
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": text} for status, text in _ERRORS.items()
}
# with stream: true, server-sent events, each an `event:` line (its type) and a `data:` line (its JSON)
EVENTS = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
            "required": ["event", "data"],
        }
    }
}


def add_anthropic_routes(
    app: FastAPI,
    chat: OpenAIServingChat,
    unless_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
) -> None:
    """unless_disconnected: the server's wrapper that cancels a non-streamed generation whose client left."""
    add_error_shape(app, PREFIX, error_body)
    messages = AnthropicServingMessages(chat)

    @app.post(PREFIX, response_model=MessagesResponse, responses={200: {"content": EVENTS}, **ERRORS})
    async def create_message(request: MessagesRequest, raw: Request) -> Response:
        result = await unless_disconnected(raw, messages.create_message(request))
        if isinstance(result, Response):
            return result
        if isinstance(result, AsyncIterator):
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(result, media_type="text/event-stream", headers=headers)
        return JSONResponse(result.model_dump())

    @app.post(f"{PREFIX}/count_tokens", responses=ERRORS)
    async def count_tokens(request: CountTokensRequest) -> CountTokensResponse:
        return await messages.count_tokens(request)
