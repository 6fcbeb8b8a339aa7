"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.context import ServerContext
from atom.server.deltas import ChoiceDelta, OutputDelta
from atom.server.disconnect import cancel_on_disconnect
from atom.server.generation import (
    final_outputs,
    sampling_params_of,
    stream_usage,
    submit,
    tokenized,
    usage_of,
)
from atom.server.logprobs import completion_logprobs
from atom.server.output_stream import OutputStream
from atom.server.protocol import CompletionRequest
from atom.server.responses import CompletionChoice, CompletionResponse
from atom.server.streaming import event_stream


async def create_completion(
    ctx: ServerContext, request: CompletionRequest, http_request: Request
) -> Response:
    arrival_time = time.monotonic()  # latency metrics count tokenizing too
    prompts = request.prompts()
    ctx.limits.check_choices(request, len(prompts))
    params = await sampling_params_of(ctx, request, request.guide_spec())
    token_ids = await tokenized(ctx, prompts, "prompt")
    stream = await submit(ctx, token_ids, params, "prompt", arrival_time, request.stream)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    # Without a tokenizer the text is empty, so the choices carry their token ids.
    with_ids = bool(request.return_token_ids) or ctx.engine.tokenizer is None
    if request.stream:
        chunks = _chunks(ctx, stream, params, response_id, request, with_ids)
        return event_stream(ctx.engine, stream, chunks)
    outputs = await cancel_on_disconnect(http_request, final_outputs(ctx, stream))
    if outputs is None:
        return Response()  # the client is gone; nobody reads this
    response = await ctx.tokenization.offload(
        _response, ctx, response_id, outputs, params.n, with_ids
    )
    return JSONResponse(response.model_dump())


def _response(
    ctx: ServerContext, response_id: str, outputs: list[RequestOutput], n: int, with_ids: bool
) -> CompletionResponse:
    choices = []
    for prompt_index, output in enumerate(outputs):
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs, _ = completion_logprobs(
                    ctx.engine.tokenizer, [], c.token_ids, c.logprobs, text_offset=0, ends=True
                )
            choices.append(
                CompletionChoice(
                    index=prompt_index * n + c.index,
                    text=c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if with_ids else None,
                    prompt_token_ids=output.prompt_token_ids if with_ids else None,
                )
            )
    return CompletionResponse(
        id=response_id, model=ctx.model, choices=choices, usage=usage_of(outputs)
    )


async def _chunks(
    ctx: ServerContext,
    stream: OutputStream,
    params: SamplingParams,
    response_id: str,
    request: CompletionRequest,
    with_ids: bool,
) -> AsyncIterator[CompletionResponse]:
    text_offsets: dict[int, int] = defaultdict(int)
    last: dict[int, OutputDelta] = {}
    async for output in stream:
        prompt_index = stream.prompt_index(output)
        last[prompt_index] = output
        choices = []
        for delta in output.choices:
            index = prompt_index * params.n + delta.index
            choice = await _chunk_choice(ctx, index, delta, text_offsets)
            choice.token_ids = delta.token_ids if with_ids else None
            choices.append(choice)
        if choices:
            yield CompletionResponse(id=response_id, model=ctx.model, choices=choices)
    if request.include_usage_in_stream:
        usage = stream_usage([last[i] for i in sorted(last)])
        yield CompletionResponse(id=response_id, model=ctx.model, choices=[], usage=usage)


async def _chunk_choice(
    ctx: ServerContext, index: int, delta: ChoiceDelta, text_offsets: dict[int, int]
) -> CompletionChoice:
    logprobs = None
    if delta.logprobs is not None:
        logprobs, text_offsets[index] = await ctx.tokenization.offload(
            completion_logprobs,
            ctx.engine.tokenizer,
            delta.context_ids,
            delta.token_ids,
            delta.logprobs,
            text_offsets[index],
            delta.finish_reason is not None,
        )
    return CompletionChoice(
        index=index,
        text=delta.text,
        logprobs=logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
    )
