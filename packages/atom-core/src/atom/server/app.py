"""The FastAPI application: OpenAI routes, health and metrics over one AsyncEngine."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from atom.server.async_engine import AsyncEngine
from atom.server.chat import create_chat_completion
from atom.server.completions import create_completion
from atom.server.errors import APIError, install_error_handlers
from atom.server.metrics import render_metrics
from atom.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(engine: AsyncEngine, served_model_name: str) -> FastAPI:
    app = FastAPI(title="ATOM", summary="OpenAI-compatible server of the ATOM native engine")
    install_error_handlers(app)

    def check_model(name: str | None) -> None:
        # Omitting the model is fine: there is only one.
        if name is not None and name != served_model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = render_metrics(engine.stats(), engine.counters)
        return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=served_model_name, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http_request: Request) -> Response:
        check_model(request.model)
        return await create_completion(engine, request, served_model_name, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http_request: Request) -> Response:
        check_model(request.model)
        return await create_chat_completion(engine, request, served_model_name, http_request)

    return app
