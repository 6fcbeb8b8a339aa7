"""The FastAPI application: OpenAI routes, vLLM's extra routes, health and metrics."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import atom
from atom.server.async_engine import AsyncEngine
from atom.server.chat import chat_prompt, create_chat_completion
from atom.server.completions import create_completion
from atom.server.context import ServerContext
from atom.server.errors import APIError, install_error_handlers
from atom.server.metrics import ServingMetrics
from atom.server.middleware import APIKeyMiddleware, RequestIdMiddleware
from atom.server.options import ServeOptions
from atom.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from atom.server.request_body import read_body
from atom.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    options: ServeOptions | None = None,
    chat_template: str | None = None,
    sampling_defaults: dict | None = None,
) -> FastAPI:
    """`chat_template`: the template text (--chat-template, already read from its file).
    `sampling_defaults`: for the sampling fields a request leaves out (--generation-config)."""
    options = options or ServeOptions(served_model_name=served_model_name)
    ctx = ServerContext.of(engine, options, chat_template, sampling_defaults)
    serving_metrics = ServingMetrics(ctx.model, engine.stats)
    engine.add_metrics(serving_metrics)
    app = FastAPI(title="ATOM", summary="OpenAI-compatible server of the ATOM native engine")
    install_error_handlers(app)
    if options.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(options.allowed_origins),
        allow_methods=list(options.allowed_methods),
        allow_headers=list(options.allowed_headers),
        allow_credentials=options.allow_credentials,
        expose_headers=["x-request-id"],
    )

    async def body_of(http_request: Request, model):
        request = await read_body(http_request, model, options.max_request_body_bytes)
        # Omitting the model is fine: there is only one.
        if request.model is not None and request.model != ctx.model:
            raise APIError(
                404,
                f"the model {request.model!r} does not exist; this server serves {ctx.model!r}",
                param="model",
                code="model_not_found",
            )
        return request

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=atom.__version__).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving_metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(http_request: Request) -> Response:
        request = await body_of(http_request, CompletionRequest)
        return await create_completion(ctx, request, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request) -> Response:
        request = await body_of(http_request, ChatCompletionRequest)
        return await create_chat_completion(ctx, request, http_request)

    @app.post("/tokenize")
    async def tokenize(http_request: Request) -> Response:
        request = await body_of(http_request, TokenizeRequest)
        if request.messages is not None:
            tokens = await chat_prompt(ctx, request)
        else:
            ctx.limits.check_prompt(request.prompt, "prompt")
            (tokens,) = await ctx.tokenization.encode([request.prompt], request.add_special_tokens)
        response = TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens
        )
        return JSONResponse(response.model_dump())

    @app.post("/detokenize")
    async def detokenize(http_request: Request) -> Response:
        request = await body_of(http_request, DetokenizeRequest)
        if any(not 0 <= t < engine.vocab_size for t in request.tokens):
            raise APIError(
                400, f"tokens must be integers in [0, {engine.vocab_size})", param="tokens"
            )
        text = await ctx.tokenization.decode(request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app
