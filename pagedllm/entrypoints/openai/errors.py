"""Every error the server returns has OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

The official clients turn the status into a typed exception (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, ...), so the status matters most; `param` names the offending field when we know it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from pagedllm.engine.protocol import EngineBusyError, EngineClosedError, RequestFailedError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedllm.errors import InputError

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers for errors that are not plain bad input (unknown model, bad key)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> ErrorResponse:
    err_type = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))


def error_response(
    message: str, status: int = 400, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param).model_dump(), status_code=status, headers=headers)


# Another API's routes (Anthropic's /v1/messages, ...) answer errors in that API's shape: a body maker of
# (message, status, param) registered on the app for a path prefix, used by every handler below and by the
# middlewares that answer before a route runs (API key, body limits, internal errors).
ErrorShape = Callable[[str, int, str | None], dict[str, Any]]


def add_error_shape(app: FastAPI, prefix: str, shape: ErrorShape) -> None:
    app.state.error_shapes = {**getattr(app.state, "error_shapes", {}), prefix: shape}


def scoped_error_response(
    scope: Scope,
    message: str,
    status: int = 400,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """error_response in the shape of the API the request's path belongs to (OpenAI's unless registered)."""
    shapes = getattr(getattr(scope.get("app"), "state", None), "error_shapes", {})
    for prefix, shape in shapes.items():
        if scope["path"].startswith(prefix):
            return JSONResponse(shape(message, status, param), status_code=status, headers=headers)
    return error_response(message, status, param, headers)


# How long a client turned away by a full queue should wait before it tries again (seconds).
RETRY_AFTER_S = 1


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as 'field: problem', and the top-level field it is about."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, InputError):  # raised by a model validator: it knows its field better than loc
        return str(cause), cause.param
    if err.get("type") == "json_invalid":
        return f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    return (f"{where}: {err.get('msg')}" if where else str(err.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        # OpenAI and vLLM say 400, not FastAPI's 422
        return scoped_error_response(request.scope, message, 400, param)

    @app.exception_handler(InputError)
    async def _input(request: Request, exc: InputError) -> JSONResponse:
        return scoped_error_response(request.scope, str(exc), 400, exc.param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return scoped_error_response(request.scope, exc.message, exc.status, exc.param)

    @app.exception_handler(EngineClosedError)
    async def _closed(request: Request, exc: EngineClosedError) -> JSONResponse:
        return scoped_error_response(request.scope, str(exc), 503)

    @app.exception_handler(EngineBusyError)
    async def _busy(request: Request, exc: EngineBusyError) -> JSONResponse:
        return scoped_error_response(
            request.scope, str(exc), 503, headers={"Retry-After": str(RETRY_AFTER_S)}
        )

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return scoped_error_response(request.scope, str(exc), 500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, method
        # keeps the exception's headers: a 405 says which methods the route allows (Allow)
        return scoped_error_response(request.scope, str(exc.detail), exc.status_code, headers=exc.headers)

    # Anything else is answered by limits.InternalErrorMiddleware: an exception handler for Exception
    # would run in Starlette's outermost middleware, which re-raises it, and uvicorn then drops the
    # keep-alive connection.
