"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from atom.server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type, param, code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body.model_dump(), status_code=exc.status)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    fields = [str(e["loc"][1]) for e in errors if len(e["loc"]) > 1 and e["type"] != "json_invalid"]
    message = "; ".join(_describe(error) for error in errors)
    body = error_body(message, "invalid_request_error", fields[0] if fields else None)
    return JSONResponse(body.model_dump(), status_code=400)


def _describe(error: dict) -> str:
    """One validation error as `field: problem`, e.g. `max_tokens: Input should be ...`."""
    kind, where = error["type"], error["loc"][1:]
    if kind == "json_invalid":
        return f"malformed JSON body: {error['ctx']['error']} (at character {where[0]})"
    if kind in ("model_attributes_type", "dict_type") and not where:
        return "the body must be a JSON object, sent as Content-Type: application/json"
    problem = str(error["ctx"]["error"]) if kind == "value_error" else error["msg"]
    return f"{'.'.join(map(str, where))}: {problem}" if where else problem


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    body = error_body(f"{exc.detail}: {request.method} {request.url.path}", kind)
    return JSONResponse(body.model_dump(), status_code=exc.status_code)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after sending this, so the server logs the traceback.
    body = error_body(f"{type(exc).__name__}: {exc}", "internal_server_error")
    return JSONResponse(body.model_dump(), status_code=500)
