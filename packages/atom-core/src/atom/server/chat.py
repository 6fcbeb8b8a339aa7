"""POST /v1/chat/completions: the tokenizer's chat template, then generation."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from starlette.requests import Request

from atom.engine.outputs import CompletionOutput, Logprobs
from atom.sampling_params import SamplingParams
from atom.server.async_engine import AsyncEngine
from atom.server.disconnect import cancel_on_disconnect
from atom.server.errors import APIError
from atom.server.generation import final_outputs, sampling_params_of, submit, usage_of
from atom.server.logprobs import chat_logprobs
from atom.server.output_stream import OutputStream
from atom.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
)
from atom.server.streaming import DeltaTracker, event_stream


async def create_chat_completion(
    engine: AsyncEngine, request: ChatCompletionRequest, model: str, http_request: Request
) -> Response:
    params = sampling_params_of(request)
    prompt = render_chat(engine.tokenizer, request)
    stream = await submit(engine, [prompt], params, param="messages")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if request.stream:
        chunks = _chunks(
            engine, stream, params, response_id, model, request.include_usage_in_stream
        )
        return event_stream(engine, stream, chunks)
    outputs = await cancel_on_disconnect(http_request, final_outputs(engine, stream))
    if outputs is None:
        return Response()  # the client is gone; nobody reads this
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=_logprobs(engine, c.token_ids, c.logprobs, params),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in outputs[0].outputs
    ]
    response = ChatCompletionResponse(
        id=response_id, model=model, choices=choices, usage=usage_of(outputs)
    )
    return JSONResponse(response.model_dump())


def render_chat(tokenizer, request: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids. The template writes any special tokens itself, so the
    tokenizer must not add its own (a second BOS)."""
    if tokenizer is None:
        raise APIError(400, "chat completions need a tokenizer; this server runs without one")
    messages = [message.for_template() for message in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError) as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def _logprobs(
    engine: AsyncEngine, token_ids: list[int], entries: Logprobs | None, params: SamplingParams
) -> ChatLogprobs | None:
    if entries is None:
        return None
    return chat_logprobs(engine.tokenizer, token_ids, entries, params.logprobs)


async def _chunks(
    engine: AsyncEngine,
    stream: OutputStream,
    params: SamplingParams,
    response_id: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[ChatCompletionChunk]:
    trackers = defaultdict(lambda: DeltaTracker(params))
    last = None
    async for output in stream:
        last = output
        choices = [
            choice
            for completion in output.outputs
            if (choice := _chunk_choice(engine, trackers[completion.index], completion, params))
        ]
        if choices:
            yield ChatCompletionChunk(id=response_id, model=model, choices=choices)
    if include_usage:
        usage = usage_of([last])
        yield ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage)


def _chunk_choice(
    engine: AsyncEngine, tracker: DeltaTracker, completion: CompletionOutput, params: SamplingParams
) -> ChatChunkChoice | None:
    delta = tracker.advance(completion)
    if delta is None:
        return None
    return ChatChunkChoice(
        index=completion.index,
        delta=DeltaMessage(role="assistant" if delta.is_first else None, content=delta.text),
        logprobs=_logprobs(engine, delta.token_ids, delta.logprobs, params),
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
    )
