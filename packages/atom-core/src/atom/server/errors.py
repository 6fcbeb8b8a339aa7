"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from atom.server.responses import ErrorInfo, ErrorResponse


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


def invalid_body(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors about a request body (locations relative to the body);
    `param` names the first field at fault."""
    fields = [".".join(map(str, e["loc"])) for e in errors if e["loc"]]
    message = "; ".join(_describe(error) for error in errors)
    return APIError(400, message, param=fields[0] if fields else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body.model_dump(), status_code=exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # Bodies are parsed by request_body.py; this covers query and path parameters.
    errors = [{**e, "loc": e["loc"][1:]} for e in exc.errors()]
    return await _api_error(request, invalid_body(errors))


def _describe(error: dict) -> str:
    """One validation error as `field: problem`, e.g. `max_tokens: Input should be ...`."""
    kind, where = error["type"], error["loc"]
    if kind == "extra_forbidden":
        return f"{'.'.join(map(str, where))}: unknown field (atom serve refuses fields it does not implement)"
    problem = str(error["ctx"]["error"]) if kind == "value_error" else error["msg"]
    return f"{'.'.join(map(str, where))}: {problem}" if where else problem


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    body = error_body(f"{exc.detail}: {request.method} {request.url.path}", kind)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after sending this, so the server logs the traceback.
    body = error_body(f"{type(exc).__name__}: {exc}", "internal_server_error")
    return JSONResponse(body.model_dump(), status_code=500)
