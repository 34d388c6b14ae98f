"""The FastAPI app: OpenAI routes plus /health, /metrics, /tokenize, /detokenize, /version, and the browser
pages: / (chat) and /kv (the paged KV cache, live; kv_routes.py, pages.py).

    python -m pagedllm.entrypoints.openai.server --model default --port 8000   # same as `pagedllm serve`

`build_app(engine, ...)` serves any EngineClient (engine/protocol.py): an AsyncEngine over an LLMEngine (or
over a test's fake one, in-process) or a DataParallelEngine; `run_server(args)` builds the real one and
runs uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
import sys
import urllib.parse
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.async_pooling import AsyncPoolingEngine
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.anthropic.routes import add_anthropic_routes
from pagedllm.entrypoints.openai.cli_args import (
    add_arguments,
    http_limits,
    make_data_parallel_engine,
    make_engine,
    make_pooling_engine,
    reasoning_options,
    uses_ray,
)
from pagedllm.entrypoints.openai.errors import error_response, install_error_handlers, scoped_error_response
from pagedllm.entrypoints.openai.kv_routes import add_kv_routes
from pagedllm.entrypoints.openai.limits import (
    BodyLimitMiddleware,
    HTTPLimits,
    InternalErrorMiddleware,
    cap_allocator_growth,
    guarded_h11_protocol,
)
from pagedllm.entrypoints.openai.lora_serving import LoRAModels, add_lora_routes, make_lora_models
from pagedllm.entrypoints.openai.model_registry import LoadedModel, ModelRegistry
from pagedllm.entrypoints.openai.model_router import ModelRouter
from pagedllm.entrypoints.openai.model_specs import ModelSpec, model_specs
from pagedllm.entrypoints.openai.ollama.routes import add_ollama_routes
from pagedllm.entrypoints.openai.pages import PAGE_PATHS, STATIC_PREFIX, add_page_routes
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import refuse_generation
from pagedllm.entrypoints.openai.serving_responses import add_responses_routes
from pagedllm.entrypoints.openai.serving_score import add_pooling_routes
from pagedllm.errors import InputError
from pagedllm.metrics import ServerMetrics
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm.server")


OPEN_PATHS = frozenset({"/health"})

# The error responses each kind of route can give, for the OpenAPI document (all with OpenAI's body).
_ERRORS = {
    400: "the request is malformed; `error.param` names the field",
    401: "missing or wrong API key",
    404: "no such model",
    408: "the request body stalled",
    413: "the request body is over --max-request-body",
    500: "the request failed inside the engine",
    503: "the model is loading, the server is shutting down, or the queue is full (see Retry-After)",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


GENERATE_ERRORS = _errors(400, 401, 404, 408, 413, 500, 503)
READ_ERRORS = _errors(401, 503)
TOKENIZER_ERRORS = _errors(400, 401, 404, 408, 413, 503)
# with stream: true, server-sent events whose data is a JSON chunk (the response's *StreamResponse), then
# the text [DONE]
SSE = {
    "text/event-stream": {
        "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    }
}


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    # with --data-parallel-size: each replica's label, alive, pid, node_id and in_flight
    replicas: list[dict[str, Any]] | None = None


def _respond(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        # no-cache / no proxy buffering: each step's chunk should reach the client right away
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(result, media_type="text/event-stream", headers=headers)
    return JSONResponse(result.model_dump())


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY`, on every route but /health (a load balancer's probe) and the
    pages' static files (no data in them): /metrics too (Prometheus sends the key with `authorization:
    {credentials: KEY}`), and /tokenize, whose work is as large as its body. A browser opening a page
    (/, /kv) cannot send a header, so there `?api_key=KEY` counts too.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would wrap `receive` and hide client
    disconnects from the handlers (Request.is_disconnected), which we need to abort abandoned requests.
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key.encode()
        self.expected = f"Bearer {api_key}".encode()

    def _allowed(self, scope: Scope) -> bool:
        path = scope["path"]
        if path in OPEN_PATHS or path.startswith(STATIC_PREFIX) or scope["method"] == "OPTIONS":
            return True
        headers = dict(scope["headers"])
        if secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
            return True
        if secrets.compare_digest(headers.get(b"x-api-key", b""), self.api_key):  # Anthropic's clients
            return True
        if path in PAGE_PATHS:
            query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
            return secrets.compare_digest(query.get("api_key", [""])[-1].encode(), self.api_key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(scope):
            message = "Invalid or missing API key"
            if scope["path"] in PAGE_PATHS:
                message += f"; open {scope['path']}?api_key=KEY"
            await scoped_error_response(scope, message, 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Await a handler's work, but cancel it (which aborts its engine requests) if the client leaves.

    Streaming handlers return their generator at once, so this only ever waits on non-streaming
    generations; a dropped stream is noticed by Starlette, which cancels the generator instead.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    finally:
        task.cancel()  # no-op when done


def build_app(
    engine: EngineClient,
    *,
    served_model_names: list[str],
    api_key: str | None = None,
    model_root: str | None = None,
    shutdown_timeout: float = 10.0,
    tool_call_parser: str = "hermes",
    limits: HTTPLimits | None = None,
    kv_debug_routes: bool = False,
    pooling: AsyncPoolingEngine | None = None,
    reasoning_parser: str | None = None,
    enable_in_reasoning: bool = False,
    loras: LoRAModels | None = None,
) -> FastAPI:
    """The app over `engine`. kv_debug_routes: add the test-only POST /kv/debug/hold (kv_routes.py).
    pooling: `engine` itself when it is the pooling engine (embeddings, rerank, score; generation refused)."""
    metrics = ServerMetrics(engine.get_stats, replicas=engine.replica_labels)
    engine.observer = metrics  # the engine records tokens and latencies as outputs arrive
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(
        engine,
        served_model_names,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        enable_in_reasoning=enable_in_reasoning,
    )
    completions.loras = chat.loras = loras  # a request's model field may name an adapter (--enable-lora)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has stopped taking connections; let in-flight requests finish, then stop the loop.
        await engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    # The last added runs first: errors outermost, then the key (before a body is read), then the body.
    app.add_middleware(BodyLimitMiddleware, limits=limits or HTTPLimits())
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(InternalErrorMiddleware)

    @app.get("/health", responses=_errors(503), response_model_exclude_none=True)
    async def health() -> HealthResponse:
        if not engine.is_running:
            return error_response("the engine loop is not running", 503)
        return HealthResponse(replicas=engine.health())

    @app.get("/version", responses=READ_ERRORS)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {"content": {metrics.content_type: {"schema": {"type": "string"}}}},
            **READ_ERRORS,
        },
    )
    async def scrape() -> Response:
        """Prometheus text exposition format."""
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", responses=READ_ERRORS)
    async def models() -> ModelList:
        cards = [
            ModelCard(id=name, root=model_root or name, max_model_len=engine.max_model_len)
            for name in served_model_names
        ]
        if loras is not None:  # each adapter, with its base as parent (vLLM's listing)
            cards += loras.cards(model_root, engine.max_model_len)
        return ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404, 503))
    async def model(model_id: str) -> ModelCard:
        chat.check_model(model_id)  # 404 for a name this server does not serve
        return ModelCard(id=model_id, root=model_root or model_id, max_model_len=engine.max_model_len)

    if loras is not None:
        add_lora_routes(app, loras, GENERATE_ERRORS)

    @app.get("/tokenizer_info", responses=READ_ERRORS)
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's endpoint: what a client needs to tokenize as the server does without a hub download
        (lm-eval's `tokenizer_backend=remote`, chosen by its "auto", reads it, then uses /tokenize and
        /detokenize)."""
        tok = chat.tokenizer
        hf = getattr(tok, "hf", tok)
        return {
            "tokenizer_class": type(hf).__name__,
            "eos_token": getattr(hf, "eos_token", None),
            "bos_token": getattr(hf, "bos_token", None),
            "pad_token": getattr(hf, "pad_token", None),
            "unk_token": getattr(hf, "unk_token", None),
            "chat_template": getattr(tok, "chat_template", None),
            "vocab_size": engine.model_config.vocab_size,
            "model_max_length": engine.max_model_len,
        }

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": SSE}, **GENERATE_ERRORS},
    )
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        refuse_generation(pooling)
        result = await _unless_disconnected(raw, completions.create_completion(request))
        return result if isinstance(result, Response) else _respond(result)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": SSE}, **GENERATE_ERRORS},
    )
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        refuse_generation(pooling)
        result = await _unless_disconnected(raw, chat.create_chat_completion(request))
        return result if isinstance(result, Response) else _respond(result)

    def tokenize_sync(request: TokenizeRequest) -> list[int]:
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise InputError("give exactly one of prompt and messages", param="prompt")
        if request.messages is not None:
            tokens = chat.render_messages(
                request.messages, add_generation_prompt=request.add_generation_prompt
            )
            if request.add_special_tokens:  # rendered text already has its special tokens; add BOS if asked
                tokens = chat.tokenizer.encode(chat.tokenizer.decode(tokens, skip_special_tokens=False))
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            tokens = chat.tokenizer.encode(request.prompt, add_special_tokens=add_special)
        return tokens

    @app.post("/tokenize", responses=TOKENIZER_ERRORS)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        # in a worker thread: megabytes of text take seconds, and the tokenizer releases the GIL
        tokens = await asyncio.to_thread(tokenize_sync, request)
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    def detokenize_sync(request: DetokenizeRequest) -> str:
        chat.check_model(request.model)
        chat.check_token_ids(request.tokens, "tokens")
        return chat.tokenizer.decode(request.tokens)

    @app.post("/detokenize", responses=TOKENIZER_ERRORS)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return DetokenizeResponse(prompt=await asyncio.to_thread(detokenize_sync, request))

    add_responses_routes(app, chat, _unless_disconnected, _respond, _errors)
    add_anthropic_routes(app, chat, _unless_disconnected)
    add_pooling_routes(app, engine, pooling, served_model_names, TOKENIZER_ERRORS)
    add_ollama_routes(app, chat, completions, model_root=model_root, unless_disconnected=_unless_disconnected)
    add_kv_routes(app, engine, debug_routes=kv_debug_routes)
    add_page_routes(app)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, minus its 422 responses: a malformed body is a 400 with OpenAI's error body
    here (errors.py), which every route declares instead."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in doc.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema


class StartupGate:
    """The ASGI app uvicorn serves from its first second: every request gets 503 with an OpenAI-style body
    ("the model is loading") until the engine has loaded and warmed up, then everything goes to the real
    app. So a load balancer sees "not ready" instead of a refused connection, and /health turns 200 only
    when the first request will be answered as fast as the tenth."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.engine: EngineClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await error_response("the model is loading; retry when /health answers 200", 503)(
                scope, receive, send
            )


def run_server(args: argparse.Namespace) -> int:
    """Listen at once (503 while loading), load and warm up the model, then serve until SIGINT/SIGTERM."""
    import threading

    import uvicorn

    specs = model_specs(args)  # several models (the model router), or None; checked before anything runs
    cap_allocator_growth()  # before the model loads and the threads start
    gate = StartupGate()
    failure: list[BaseException] = []

    class DrainingServer(uvicorn.Server):
        """On shutdown uvicorn waits for open connections, then cancels them mid-response. Drain the
        engine first instead: stop listening, let in-flight requests finish for up to the timeout and end
        the rest with an in-band error, so that every client gets a complete response."""

        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()
            if gate.engine is not None:
                await gate.engine.shutdown(timeout=args.shutdown_timeout)
            await super().shutdown(sockets=sockets)
            # uvicorn re-raises a captured SIGTERM after shutdown, so the process would die of it (exit
            # 143) even though it drained cleanly; a supervisor should see 0. SIGINT is left as it is.
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

        async def on_tick(self, counter: int) -> bool:
            if isinstance(gate.engine, ModelRegistry):
                gate.engine.start()  # its idle reaper, on this loop (once)
            # Ray (--data-parallel-size) installs its own handler of fatal signals, SIGTERM among them, when
            # the engine starts; take SIGINT and SIGTERM back (here on the main thread) so that they drain.
            if data_parallel and gate.engine is not None and not self._signals_restored:
                self._signals_restored = True
                if threading.current_thread() is threading.main_thread():
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        signal.signal(sig, self.handle_exit)
            return await super().on_tick(counter)

        _signals_restored = False

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = args.served_model_name or args.model
    if specs is not None:
        name = ", ".join(spec.name for spec in specs)
    # lifespan off: the real app arrives after uvicorn's startup; DrainingServer stops its engine instead
    limits = http_limits(args)
    data_parallel = uses_ray(args)  # checked before listening: a bad value or missing ray is exit 2
    reasoning_options(args)  # checked before listening: a bad --reasoning-parser is exit 2
    config = uvicorn.Config(
        gate,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        lifespan="off",
        # no WebSocket route: uvicorn imports no websockets library (a broken one cannot stop a start) and
        # answers an upgrade request as plain HTTP
        ws="none",
        http=guarded_h11_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,
        h11_max_incomplete_event_size=64 * 1024,  # the request line and headers
    )
    server = DrainingServer(config)

    def load() -> None:
        try:
            if specs is not None:
                registry = _model_registry(args, specs, limits)
                registry.preload(specs[0].name)  # the first model now (a bad option fails start-up)
                first = registry.entries[specs[0].name].loaded
                gate.engine = registry  # type: ignore[assignment]  (what DrainingServer shuts down)
                gate.app = _outer_middleware(
                    ModelRouter(registry, getattr(first.app.state, "error_shapes", {})), args.api_key, limits
                )
                logger.info("ready: serving %s on http://%s:%d", name, args.host, args.port)
                return
            pooling = make_pooling_engine(args)  # an embedder / cross-encoder (which refuses replicas)
            if pooling is not None:
                gate.engine = pooling
            elif data_parallel:  # replicas on Ray, each loaded and warmed up in its own process
                gate.engine = make_data_parallel_engine(args)
            else:
                engine = make_engine(args)
                engine.warm_up()
                gate.engine = AsyncEngine(engine, max_num_waiting=args.max_num_waiting)
            loras = make_lora_models(args, gate.engine, [name])  # --enable-lora: --lora-modules checked now
            gate.app = _app_of(args, gate.engine, name, limits, pooling, loras)
            logger.info("ready: serving %s on http://%s:%d", name, args.host, args.port)
        except BaseException as e:  # a bad option or model: stop the server and report it as the CLI would
            failure.append(e)
            server.should_exit = True

    logger.info("loading %s; http://%s:%d answers 503 until it is ready", name, args.host, args.port)
    threading.Thread(target=load, name="pagedllm-load", daemon=True).start()
    server.run()
    if failure:
        raise failure[0]
    return 0


def _load_model(args: argparse.Namespace, spec: ModelSpec, limits: HTTPLimits) -> LoadedModel:
    """One model of a server of several: the one-model server's engine and app, built as run_server builds
    them (in a worker thread; its engine loop starts here)."""
    args = argparse.Namespace(
        **{**vars(args), "model": spec.path, "served_model_name": spec.name, "models": None}
    )
    pooling = make_pooling_engine(args)
    engine: EngineClient
    if pooling is not None:
        engine = pooling
    else:
        llm = make_engine(args)
        llm.warm_up()
        engine = AsyncEngine(llm, max_num_waiting=args.max_num_waiting)
    app = _app_of(args, engine, spec.name, limits, pooling)
    return LoadedModel(app=app, engine=engine, metrics=app.state.metrics)


def _app_of(args: argparse.Namespace, engine, name: str, limits: HTTPLimits, pooling, loras=None) -> FastAPI:
    """The one-model app over `engine` as the serve options ask (a server of several builds one a model)."""
    reasoning_parser, enable_in_reasoning = reasoning_options(args)
    return build_app(
        engine,
        served_model_names=[name],
        api_key=args.api_key,
        model_root=args.model,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        limits=limits,
        kv_debug_routes=args.kv_debug_routes,
        pooling=pooling,
        reasoning_parser=reasoning_parser,
        enable_in_reasoning=enable_in_reasoning,
        loras=loras,
    )


def _model_registry(args: argparse.Namespace, specs: list[ModelSpec], limits: HTTPLimits) -> ModelRegistry:
    return ModelRegistry(
        specs,
        lambda spec: _load_model(args, spec, limits),
        load_timeout_s=args.load_timeout_s,
        max_loaded_models=args.max_loaded_models,
        idle_unload_s=args.idle_unload_s,
        shutdown_timeout=args.shutdown_timeout,
    )


def _outer_middleware(app: ASGIApp, api_key: str | None, limits: HTTPLimits) -> ASGIApp:
    """The middlewares build_app puts around a one-model app, around the model router (whose own routes,
    /v1/models and /metrics, need the key too; each model's app checks again, which costs nothing)."""
    app = BodyLimitMiddleware(app, limits=limits)
    if api_key:
        app = APIKeyMiddleware(app, api_key=api_key)
    return InternalErrorMiddleware(app)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except InputError as e:
        sys.stderr.write(f"pagedllm serve: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
