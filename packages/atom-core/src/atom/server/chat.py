"""POST /v1/chat/completions: the chat template (the tokenizer's or --chat-template), then
generation."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from atom.engine.outputs import Logprobs, RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.context import ServerContext
from atom.server.deltas import ChoiceDelta
from atom.server.disconnect import cancel_on_disconnect
from atom.server.errors import APIError
from atom.server.generation import (
    final_outputs,
    sampling_params_of,
    stream_usage,
    submit,
    usage_of,
)
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from atom.server.streaming import event_stream
from atom.server.tool_calls import (
    ParsedToolCall,
    ToolCallDelta,
    ToolCallReader,
    forced_call_guide,
    tool_call_reader,
)


async def create_chat_completion(
    ctx: ServerContext, request: ChatCompletionRequest, http_request: Request
) -> Response:
    arrival_time = time.monotonic()  # latency metrics count the template and tokenizing too
    ctx.limits.check_choices(request, 1)
    params = await sampling_params_of(ctx, request, _guide(request))
    if _markers_are_special_tokens(ctx, request):
        # Decoding would drop them, and with them the calls (as vLLM's parsers do).
        params = dataclasses.replace(params, skip_special_tokens=False)
    prompt = await chat_prompt(ctx, request)
    stream = await submit(ctx, [prompt], params, "messages", arrival_time, request.stream)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if request.stream:
        chunks = _chunks(ctx, stream, params, response_id, request)
        return event_stream(ctx.engine, stream, chunks)
    outputs = await cancel_on_disconnect(http_request, final_outputs(ctx, stream))
    if outputs is None:
        return Response()  # the client is gone; nobody reads this
    response = await ctx.tokenization.offload(
        _response, ctx, response_id, outputs[0], params, request
    )
    return JSONResponse(response.model_dump())


def _markers_are_special_tokens(ctx: ServerContext, request: ChatCompletionRequest) -> bool:
    reader = tool_call_reader(request, ctx.options.tool_call_parser)
    tokenizer = ctx.engine.tokenizer
    if reader is None or tokenizer is None:
        return False
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    special = {token.content for token in added if token.special}
    return not special.isdisjoint(reader.markers)


def _guide(request: ChatCompletionRequest):
    guide, forced_call = request.guide_spec(), forced_call_guide(request)
    if guide is not None and forced_call is not None:
        raise APIError(
            400, f"{guide.param} and a forced tool_choice cannot be combined", param=guide.param
        )
    return guide or forced_call


async def chat_prompt(ctx: ServerContext, request: ChatCompletionRequest | TokenizeRequest):
    """The prompt's token ids; messages too long to fit the context are refused before
    the template runs."""
    ctx.limits.check_prompt("".join(m.text for m in request.messages), "messages")
    template_kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    if getattr(request, "tools", None):
        template_kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
    prompt = await ctx.tokenization.render_chat(
        [message.for_template() for message in request.messages],
        request.add_generation_prompt,
        template_kwargs,
    )
    ctx.limits.check_prompt(prompt, "messages")
    return prompt


def _response(
    ctx: ServerContext,
    response_id: str,
    output: RequestOutput,
    params: SamplingParams,
    request: ChatCompletionRequest,
) -> ChatCompletionResponse:
    choices = []
    for c in output.outputs:
        content, calls = c.text, []
        reader = tool_call_reader(request, ctx.options.tool_call_parser)
        if reader is not None:
            content, _ = reader.read(c.text, final=True)
            calls = reader.calls
            content = (content.strip() or None) if calls else content
        choices.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=content, tool_calls=_tool_calls(calls)),
                logprobs=_logprobs(ctx, [], c.token_ids, c.logprobs, params, ends=True),
                finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=response_id, model=ctx.model, choices=choices, usage=usage_of([output])
    )


def _logprobs(
    ctx: ServerContext,
    context_ids: list[int],
    token_ids: list[int],
    entries: Logprobs | None,
    params: SamplingParams,
    ends: bool,
) -> ChatLogprobs | None:
    """ends: the output ends with token_ids."""
    if entries is None:
        return None
    tokenizer = ctx.engine.tokenizer
    return chat_logprobs(tokenizer, context_ids, token_ids, entries, params.logprobs, ends)


def _tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


def _finish_reason(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


async def _chunks(
    ctx: ServerContext,
    stream: OutputStream,
    params: SamplingParams,
    response_id: str,
    request: ChatCompletionRequest,
) -> AsyncIterator[ChatCompletionChunk]:
    readers = defaultdict(lambda: tool_call_reader(request, ctx.options.tool_call_parser))
    last = None
    async for output in stream:
        last = output
        choices = []
        for delta in output.choices:
            choice = await _chunk_choice(ctx, delta, params)
            reader = readers[delta.index]
            if reader is None or _take_tool_calls(choice, delta, reader):
                choices.append(choice)
        if choices:
            yield ChatCompletionChunk(id=response_id, model=ctx.model, choices=choices)
    if request.include_usage_in_stream:
        usage = stream_usage([last])
        yield ChatCompletionChunk(id=response_id, model=ctx.model, choices=[], usage=usage)


def _take_tool_calls(choice: ChatChunkChoice, delta: ChoiceDelta, reader: ToolCallReader) -> bool:
    """Moves the tool calls in the choice's text into its delta's tool_calls; False when
    that leaves the chunk empty: as in vLLM, such a chunk is not sent."""
    content, pieces = reader.read(delta.text, final=delta.finish_reason is not None)
    choice.delta.content = content
    if pieces:
        choice.delta.tool_calls = [_delta_tool_call(piece) for piece in pieces]
    choice.finish_reason = _finish_reason(delta.finish_reason, bool(reader.calls))
    return bool(content or pieces or choice.delta.role or choice.finish_reason or choice.logprobs)


def _delta_tool_call(piece: ToolCallDelta) -> DeltaToolCall:
    return DeltaToolCall(
        index=piece.index,
        id=piece.id,
        type="function" if piece.id else None,
        function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
    )


async def _chunk_choice(
    ctx: ServerContext, delta: ChoiceDelta, params: SamplingParams
) -> ChatChunkChoice:
    logprobs = None
    if delta.logprobs is not None:
        logprobs = await ctx.tokenization.offload(
            _logprobs,
            ctx,
            delta.context_ids,
            delta.token_ids,
            delta.logprobs,
            params,
            delta.finish_reason is not None,
        )
    return ChatChunkChoice(
        index=delta.index,
        delta=DeltaMessage(role="assistant" if delta.is_first else None, content=delta.text),
        logprobs=logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
    )
