"""POST /v1/chat/completions: the chat template (the tokenizer's or --chat-template), then
generation."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from atom.engine.outputs import Logprobs, RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.context import ServerContext
from atom.server.disconnect import cancel_on_disconnect
from atom.server.generation import final_outputs, sampling_params_of, submit, usage_of
from atom.server.logprobs import chat_logprobs
from atom.server.output_stream import OutputStream
from atom.server.protocol import ChatCompletionRequest, TokenizeRequest
from atom.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
)
from atom.server.streaming import Delta, DeltaTracker, event_stream


async def create_chat_completion(
    ctx: ServerContext, request: ChatCompletionRequest, http_request: Request
) -> Response:
    ctx.limits.check_choices(request, 1)
    params = sampling_params_of(request)
    prompt = await chat_prompt(ctx, request)
    stream = await submit(ctx, [prompt], params, param="messages")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if request.stream:
        chunks = _chunks(ctx, stream, params, response_id, request.include_usage_in_stream)
        return event_stream(ctx.engine, stream, chunks)
    outputs = await cancel_on_disconnect(http_request, final_outputs(ctx, stream))
    if outputs is None:
        return Response()  # the client is gone; nobody reads this
    response = await ctx.tokenization.offload(_response, ctx, response_id, outputs[0], params)
    return JSONResponse(response.model_dump())


async def chat_prompt(ctx: ServerContext, request: ChatCompletionRequest | TokenizeRequest):
    """The prompt's token ids; messages too long to fit the context are refused before
    the template runs."""
    ctx.limits.check_prompt("".join(m.text for m in request.messages), "messages")
    prompt = await ctx.tokenization.render_chat(
        [message.for_template() for message in request.messages],
        request.add_generation_prompt,
        getattr(request, "chat_template_kwargs", None) or {},
    )
    ctx.limits.check_prompt(prompt, "messages")
    return prompt


def _response(
    ctx: ServerContext, response_id: str, output: RequestOutput, params: SamplingParams
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=_logprobs(ctx, c.token_ids, c.logprobs, params),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in output.outputs
    ]
    return ChatCompletionResponse(
        id=response_id, model=ctx.model, choices=choices, usage=usage_of([output])
    )


def _logprobs(
    ctx: ServerContext, token_ids: list[int], entries: Logprobs | None, params: SamplingParams
) -> ChatLogprobs | None:
    if entries is None:
        return None
    return chat_logprobs(ctx.engine.tokenizer, token_ids, entries, params.logprobs)


async def _chunks(
    ctx: ServerContext,
    stream: OutputStream,
    params: SamplingParams,
    response_id: str,
    include_usage: bool,
) -> AsyncIterator[ChatCompletionChunk]:
    trackers = defaultdict(lambda: DeltaTracker(params))
    last = None
    async for output in stream:
        last = output
        choices = []
        for completion in output.outputs:
            delta = trackers[completion.index].advance(completion)
            if delta is not None:
                choices.append(await _chunk_choice(ctx, completion.index, delta, params))
        if choices:
            yield ChatCompletionChunk(id=response_id, model=ctx.model, choices=choices)
    if include_usage:
        usage = usage_of([last])
        yield ChatCompletionChunk(id=response_id, model=ctx.model, choices=[], usage=usage)


async def _chunk_choice(
    ctx: ServerContext, index: int, delta: Delta, params: SamplingParams
) -> ChatChunkChoice:
    logprobs = None
    if delta.logprobs is not None:
        logprobs = await ctx.tokenization.offload(
            _logprobs, ctx, delta.token_ids, delta.logprobs, params
        )
    return ChatChunkChoice(
        index=index,
        delta=DeltaMessage(role="assistant" if delta.is_first else None, content=delta.text),
        logprobs=logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
    )
