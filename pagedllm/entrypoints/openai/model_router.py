"""The ASGI app of a server of several models: it answers what is about all models itself and hands every
other request, unchanged, to the one-model app of the model the request names.

    GET /v1/models, /v1/models/{id}   every model, with `status` (loaded / loading / unloaded)
    GET /metrics                      each loaded model's metrics with a `model_name` label (vLLM's), plus
                                      pagedllm:model_loaded{model_name}
    GET /health                       200 while the server runs (models load on demand)
    GET /api/tags, /api/ps            Ollama's lists: every model / the loaded ones
    /kv, /kv/...                      the model in `?model=` (taken off the query before the model's app
                                      sees it), else the default model
    a request with a JSON body        the model in its `model` (Ollama's /api/show: or `name`) field; none:
                                      the first model given
    anything else                     (/, /version, static files, ...) the most recently used loaded model

The request waits while its model loads (registry.acquire) and counts as in flight until its response has
been sent, streamed responses included, so that no model is unloaded under a request.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from types import SimpleNamespace
from typing import Any, Literal

from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import error_response, scoped_error_response
from pagedllm.entrypoints.openai.limits import replaying
from pagedllm.entrypoints.openai.model_registry import ModelEntry, ModelLoadTimeout, ModelRegistry
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.metrics import CONTENT_TYPE_LATEST, render_by_model

LOAD_RETRY_AFTER_S = 5


class RoutedModelCard(ModelCard):
    """A /v1/models entry of a server of several models: the card plus whether the model is loaded."""

    status: Literal["loaded", "loading", "unloaded"]


def model_cards(registry: ModelRegistry) -> list[dict[str, Any]]:
    """The /v1/models entries (a function, so that other kinds of entries can be added to the list)."""
    cards = []
    for name, entry in registry.entries.items():
        loaded = entry.loaded if entry.state == "loaded" else None
        max_len = int(loaded.engine.max_model_len) if loaded is not None else None
        card = RoutedModelCard(id=name, root=entry.spec.path, max_model_len=max_len, status=entry.state)
        cards.append(card.model_dump())
    return cards


def _ollama_name(model: str, registry: ModelRegistry) -> str:
    base = model.removesuffix(":latest")
    return base if base in registry.entries and model not in registry.entries else model


class ModelRouter:
    def __init__(self, registry: ModelRegistry, error_shapes: dict[str, Any] | None = None):
        self.registry = registry
        # the error shapes of the models' apps (Anthropic's routes), for errors answered here
        self.state = SimpleNamespace(error_shapes=error_shapes or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET":
            handler = {
                "/health": self._health,
                "/v1/models": self._models,
                "/metrics": self._metrics,
                "/api/tags": self._ollama_tags,
                "/api/ps": self._ollama_ps,
            }.get(path)
            if handler is not None:
                await (await handler(scope))(scope, receive, send)
                return
            if path.startswith("/v1/models/"):
                await self._model(scope, path.removeprefix("/v1/models/"))(scope, receive, send)
                return
        if path == "/kv" or path.startswith("/kv/"):
            name, scope = self._take_query_model(scope)
            await self._dispatch(name or self.registry.default, scope, receive, send)
            return
        body = await _read_body(receive)
        name = self._body_model(body, path)
        if name is None:
            name = self.registry.default if body else self._recent()
        await self._dispatch(name, scope, replaying(body, receive), send)

    # ------------------------------------------------------------------ dispatch

    async def _dispatch(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        entry = self.registry.get(name)
        if entry is None:
            await self._unknown(scope, name)(scope, receive, send)
            return
        try:
            loaded = await self.registry.acquire(entry)
        except ModelLoadTimeout as e:
            headers = {"Retry-After": str(LOAD_RETRY_AFTER_S)}
            await self._error(scope, str(e), 503, headers=headers)(scope, receive, send)
            return
        except Exception as e:
            await self._error(scope, f"loading the model `{name}` failed: {e}", 500)(scope, receive, send)
            return
        try:
            await loaded.app(scope, receive, send)
        finally:
            self.registry.release(entry)

    def _body_model(self, body: bytes, path: str) -> str | None:
        if not body:
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None  # the model's app answers 400 for the malformed body
        if not isinstance(data, dict):
            return None
        model = data.get("model") or (data.get("name") if path == "/api/show" else None)
        if not isinstance(model, str) or not model:
            return None
        return _ollama_name(model, self.registry) if path.startswith("/api/") else model

    def _recent(self) -> str:
        loaded = [e for e in self.registry.entries.values() if e.state == "loaded"]
        return max(loaded, key=lambda e: e.last_used).name if loaded else self.registry.default

    @staticmethod
    def _take_query_model(scope: Scope) -> tuple[str | None, Scope]:
        pairs = urllib.parse.parse_qsl(
            scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
        )
        names = [v for k, v in pairs if k == "model"]
        if not names:
            return None, scope
        rest = urllib.parse.urlencode([(k, v) for k, v in pairs if k != "model"]).encode("latin-1")
        return names[-1], {**scope, "query_string": rest}

    # ------------------------------------------------------------------ errors

    def _error(self, scope: Scope, message: str, status: int, **kw: Any) -> Response:
        if scope["path"].startswith("/api/"):  # Ollama's shape
            return JSONResponse({"error": message}, status_code=status, headers=kw.get("headers"))
        return scoped_error_response({**scope, "app": self}, message, status, **kw)

    def _unknown(self, scope: Scope, name: str) -> Response:
        if scope["path"].startswith("/api/"):
            return JSONResponse({"error": f'model "{name}" not found, try pulling it first'}, status_code=404)
        return self._error(scope, f"The model `{name}` does not exist.", 404, param="model")

    # ------------------------------------------------------------------ routes about all models

    async def _health(self, scope: Scope) -> Response:
        if not self.registry.is_running:
            return error_response("the server is shutting down", 503)
        return JSONResponse({"status": "ok"})

    async def _models(self, scope: Scope) -> Response:
        return JSONResponse({"object": "list", "data": model_cards(self.registry)})

    def _model(self, scope: Scope, model_id: str) -> Response:
        for card in model_cards(self.registry):
            if card["id"] == model_id:
                return JSONResponse(card)
        return self._unknown(scope, model_id)

    async def _metrics(self, scope: Scope) -> Response:
        metrics = {name: loaded.metrics for name, loaded in self.registry.loaded().items()}
        text = render_by_model(metrics, list(self.registry.entries))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def _ollama_tags(self, scope: Scope) -> Response:
        """Every model: a loaded one as its app lists it, an unloaded one from its file alone."""
        models = []
        for name, entry in self.registry.entries.items():
            loaded = entry.loaded if entry.state == "loaded" else None
            if loaded is not None:
                models += (await _get_json(loaded.app, scope, "/api/tags")).get("models", [])
            else:
                listed = name if ":" in name else f"{name}:latest"
                models.append(
                    {"name": listed, "model": listed, "modified_at": _mtime(entry), "size": _size(entry),
                     "digest": "", "details": {}}
                )  # fmt: skip
        return JSONResponse({"models": models})

    async def _ollama_ps(self, scope: Scope) -> Response:
        models = []
        for loaded in self.registry.loaded().values():
            models += (await _get_json(loaded.app, scope, "/api/ps")).get("models", [])
        return JSONResponse({"models": models})


def _mtime(entry: ModelEntry) -> str:
    import os

    try:
        t = os.path.getmtime(entry.spec.path)
    except OSError:
        t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _size(entry: ModelEntry) -> int:
    import os

    try:
        return os.path.getsize(entry.spec.path)
    except OSError:
        return 0


async def _read_body(receive: Receive) -> bytes:
    """The request body (BodyLimitMiddleware, outside this app, already read it whole and bounded)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _get_json(app: Any, scope: Scope, path: str) -> dict[str, Any]:
    """GET `path` from a model's app in-process, with this request's headers (its API key)."""
    sub = {**scope, "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b""}
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(sub, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
