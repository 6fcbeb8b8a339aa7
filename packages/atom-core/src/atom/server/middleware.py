"""ASGI middleware: the API key check and the X-Request-Id echo.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a handler
and its client's disconnect message (disconnect.py waits for it).
"""

from __future__ import annotations

import hmac
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from atom.server.errors import error_body


class APIKeyMiddleware:
    """/v1 routes need `Authorization: Bearer <key>` (as vLLM's --api-key); /health,
    /metrics, /version, /tokenize and /detokenize stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                body = error_body(
                    "a valid API key is needed: Authorization: Bearer <key>",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await JSONResponse(body.model_dump(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the client's own, or a fresh one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
