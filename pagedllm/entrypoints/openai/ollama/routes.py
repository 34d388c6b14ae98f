"""Ollama's routes on the OpenAI server's app: /api/chat, /api/generate, /api/tags, /api/show, /api/ps,
/api/version; /api/embed and the older /api/embeddings through the pooling routes' embedding service
(app.state.embeddings: an embedding model's server; a generative one answers 400 naming model, as
/v1/embeddings does).

Every error these routes raise has Ollama's body, {"error": "..."}, with the status Ollama gives (400 bad
input, 404 unknown model, 500 a failed request, 503 a full queue); a route class turns the exceptions
the OpenAI path raises (errors.py) into it. What the app answers before a route runs (401 without the
key, 413 a body too large) keeps the OpenAI body, whose "error" Ollama's clients read all the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

from pagedllm.engine.async_pooling import AsyncPoolingEngine
from pagedllm.engine.protocol import EngineBusyError, EngineClosedError, RequestFailedError
from pagedllm.entrypoints.openai.errors import RETRY_AFTER_S, APIError, _validation_message
from pagedllm.entrypoints.openai.ollama import model_info
from pagedllm.entrypoints.openai.ollama.protocol import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    OllamaError,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaListModel,
    OllamaListResponse,
    OllamaProcessModel,
    OllamaProcessResponse,
    OllamaShowRequest,
    OllamaShowResponse,
    OllamaVersionResponse,
)
from pagedllm.entrypoints.openai.ollama.serving import (
    NDJSON,
    OllamaServing,
    StreamError,
    listed_name,
    validation_error,
)
from pagedllm.entrypoints.openai.protocol import ErrorResponse as OpenAIErrorResponse
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import refuse_generation
from pagedllm.errors import InputError

# The Ollama release whose API these routes follow (think, tool_name, tool_calls' index, /api/ps'
# context_length): clients such as Open WebUI turn features on by this number.
OLLAMA_VERSION = "0.12.0"
# /api/ps' expires_at for a model that is never unloaded (Ollama writes a far-future time for keep_alive -1)
NEVER = "2318-11-29T00:00:00Z"

_ERRORS = {
    400: "the request is malformed; the message names the field",
    401: "missing or wrong API key (OpenAI's error body)",
    404: "no such model",
    413: "the request body is over --max-request-body (OpenAI's error body)",
    500: "the request failed inside the engine",
    503: "the server is shutting down or its queue is full (see Retry-After)",
}
_OPENAI_BODY = {401, 413}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {
        c: {"model": OpenAIErrorResponse if c in _OPENAI_BODY else OllamaError, "description": _ERRORS[c]}
        for c in codes
    }


GENERATE_ERRORS = _errors(400, 401, 404, 413, 500, 503)
# with stream (Ollama's default): one JSON chunk a line, the last with done true and the timings
STREAMED = {NDJSON: {"schema": {"type": "string", "description": "one JSON object a line"}}}


def error(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(OllamaError(error=message).model_dump(), status_code=status, headers=headers)


def _as_error(exc: Exception) -> JSONResponse | None:
    """Ollama's error response for an exception the OpenAI path raises; None for any other."""
    if isinstance(exc, RequestValidationError):
        return error(_validation_message(exc)[0], 400)
    if isinstance(exc, ValidationError):
        return error(str(validation_error(exc, "body")), 400)
    if isinstance(exc, InputError):  # Ollama's body has no param: the message names the field
        message = str(exc)
        if exc.param and exc.param.split(".")[-1] not in message:
            message = f"{exc.param}: {message}"
        return error(message, 400)
    if isinstance(exc, APIError):
        return error(exc.message, exc.status)
    if isinstance(exc, EngineBusyError):
        return error(str(exc), 503, headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineClosedError):
        return error(str(exc), 503)
    if isinstance(exc, (RequestFailedError, StreamError)):
        return error(str(exc), 500)
    return None


class OllamaRoute(APIRoute):
    """A route whose errors have Ollama's body (FastAPI's custom-route-class hook: the body's validation
    runs inside the handler this wraps)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            if request.method == "POST":
                # Ollama reads every body as JSON whatever its Content-Type, and its own docs' `curl -d`
                # sends application/x-www-form-urlencoded: say JSON, so that FastAPI parses it as such
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
                request = Request(scope, request.receive)
            try:
                return await handler(request)
            except Exception as exc:
                response = _as_error(exc)
                if response is None:
                    raise
                return response

        return route


def _respond(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type=NDJSON, headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump(exclude_none=True))


def add_ollama_routes(
    app: FastAPI,
    chat: OpenAIServingChat,
    completions: OpenAIServingCompletion,
    *,
    model_root: str | None = None,
    unless_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]] | None = None,
) -> None:
    """Ollama's API over the app's chat and completion paths. model_root: the --model the server loaded
    (its file is what /api/tags and /api/show describe); unless_disconnected: the server's guard that
    aborts a non-streamed generation whose client left."""
    serving = OllamaServing(chat, completions)
    router = APIRouter(route_class=OllamaRoute, tags=["ollama"])
    facts: list[model_info.ModelFacts] = []

    async def describe() -> model_info.ModelFacts:
        if not facts:  # once: a GGUF header is read (a tenth of a second or so)
            engine = chat.engine
            facts.append(
                await asyncio.to_thread(model_info.describe, engine.model_config, chat.tokenizer, model_root)
            )
        return facts[0]

    async def run(raw: Request, make_work: Callable[[], Awaitable[Any]]) -> Response:
        # an embedding / scoring model's server: 400 naming model, as its other generative routes answer
        refuse_generation(chat.engine if isinstance(chat.engine, AsyncPoolingEngine) else None)
        work = make_work()
        result = await (unless_disconnected(raw, work) if unless_disconnected else work)
        return result if isinstance(result, Response) else _respond(result)

    @router.post(
        "/api/chat",
        response_model=OllamaChatResponse,
        responses={200: {"content": STREAMED}, **GENERATE_ERRORS},
    )
    async def api_chat(request: OllamaChatRequest, raw: Request) -> Response:
        return await run(raw, lambda: serving.create_chat(request))

    @router.post(
        "/api/generate",
        response_model=OllamaGenerateResponse,
        responses={200: {"content": STREAMED}, **GENERATE_ERRORS},
    )
    async def api_generate(request: OllamaGenerateRequest, raw: Request) -> Response:
        return await run(raw, lambda: serving.create_generate(request))

    @router.get("/api/tags", responses=_errors(401))
    async def api_tags() -> OllamaListResponse:
        f = await describe()
        models = [
            OllamaListModel(
                name=listed_name(name),
                model=listed_name(name),
                modified_at=f.modified_at,
                size=f.size,
                digest=f.digest,
                details=f.details,
            )
            for name in chat.served_model_names
        ]
        return OllamaListResponse(models=models)

    @router.post("/api/show", responses=_errors(400, 401, 404, 413))
    async def api_show(request: OllamaShowRequest) -> OllamaShowResponse:
        name = request.model or request.name
        serving.served_name(name or "")
        f = await describe()
        capabilities = ["completion", "tools"] + (["thinking"] if serving.thinks else [])
        return OllamaShowResponse(
            modelfile=f"# served by pagedllm\nFROM {model_root or name}\n",
            parameters="",
            template=f.template,
            details=f.details,
            model_info=f.model_info,
            capabilities=capabilities,
            modified_at=f.modified_at,
        )

    @router.get("/api/ps", responses=_errors(401))
    async def api_ps() -> OllamaProcessResponse:
        f = await describe()
        models = [
            OllamaProcessModel(
                name=listed_name(name),
                model=listed_name(name),
                size=f.size,  # the weights' files; the KV cache is the server's own (see /metrics)
                digest=f.digest,
                details=f.details,
                expires_at=NEVER,
                size_vram=0,
                context_length=chat.max_model_len,
            )
            for name in chat.served_model_names
        ]
        return OllamaProcessResponse(models=models)

    @router.get("/api/version", responses=_errors(401))
    async def api_version() -> OllamaVersionResponse:
        return OllamaVersionResponse(version=OLLAMA_VERSION)

    async def embed(model: str, inputs: str | list[str], truncate: bool, dimensions: int | None):
        serving.served_name(model)  # 404 for another name
        embeddings = app.state.embeddings
        limit = chat.max_model_len if truncate else None  # Ollama cuts an input to the context by default
        return await embeddings.embed(inputs, truncate_prompt_tokens=limit, dimensions=dimensions)

    @router.post("/api/embed", responses=_errors(400, 401, 404, 500, 503))
    async def api_embed(request: OllamaEmbedRequest) -> OllamaEmbedResponse:
        start = time.perf_counter_ns()
        if request.options:  # the sampling and runner options have no meaning for a pooling forward
            raise InputError(
                f"options are not taken by /api/embed: {', '.join(sorted(request.options))}", "options"
            )
        result = await embed(request.model, request.input, request.truncate, request.dimensions)
        return OllamaEmbedResponse(
            model=request.model,
            embeddings=result.vectors.tolist(),
            total_duration=time.perf_counter_ns() - start,
            prompt_eval_count=result.prompt_tokens,
        )

    @router.post("/api/embeddings", responses=_errors(400, 401, 404, 500, 503))
    async def api_embeddings(request: OllamaEmbeddingsRequest) -> OllamaEmbeddingsResponse:
        if request.options:
            raise InputError(
                f"options are not taken by /api/embeddings: {', '.join(sorted(request.options))}", "options"
            )
        result = await embed(request.model, [request.prompt], True, None)
        return OllamaEmbeddingsResponse(embedding=result.vectors[0].tolist())

    app.include_router(router)
