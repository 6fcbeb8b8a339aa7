"""POST /v1/completions."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.async_engine import AsyncEngine
from atom.server.disconnect import cancel_on_disconnect
from atom.server.generation import final_outputs, sampling_params_of, submit, usage_of
from atom.server.logprobs import completion_logprobs
from atom.server.output_stream import OutputStream
from atom.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from atom.server.streaming import Delta, DeltaTracker, event_stream


async def create_completion(
    engine: AsyncEngine, request: CompletionRequest, model: str, http_request: Request
) -> Response:
    params = sampling_params_of(request)
    stream = await submit(engine, request.prompts(), params, param="prompt")
    response_id = f"cmpl-{uuid.uuid4().hex}"
    if request.stream:
        chunks = _chunks(
            engine, stream, params, response_id, model, request.include_usage_in_stream
        )
        return event_stream(engine, stream, chunks)
    outputs = await cancel_on_disconnect(http_request, final_outputs(engine, stream))
    if outputs is None:
        return Response()  # the client is gone; nobody reads this
    response = CompletionResponse(
        id=response_id,
        model=model,
        choices=[
            choice
            for prompt_index, output in enumerate(outputs)
            for choice in _choices(engine, prompt_index, output, params.n)
        ],
        usage=usage_of(outputs),
    )
    return JSONResponse(response.model_dump())


def _choices(
    engine: AsyncEngine, prompt_index: int, output: RequestOutput, n: int
) -> list[CompletionChoice]:
    return [
        CompletionChoice(
            index=prompt_index * n + c.index,
            text=c.text,
            logprobs=None
            if c.logprobs is None
            else completion_logprobs(engine.tokenizer, c.token_ids, c.logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in output.outputs
    ]


async def _chunks(
    engine: AsyncEngine,
    stream: OutputStream,
    params: SamplingParams,
    response_id: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[CompletionResponse]:
    trackers = defaultdict(lambda: DeltaTracker(params))
    text_offsets: dict[int, int] = defaultdict(int)
    finals: dict[int, RequestOutput] = {}
    async for output in stream:
        prompt_index = stream.prompt_index(output)
        finals[prompt_index] = output
        choices = []
        for completion in output.outputs:
            index = prompt_index * params.n + completion.index
            delta = trackers[index].advance(completion)
            if delta is not None:
                choices.append(_chunk_choice(engine, index, delta, text_offsets))
        if choices:
            yield CompletionResponse(id=response_id, model=model, choices=choices)
    if include_usage:
        usage = usage_of([finals[i] for i in sorted(finals)])
        yield CompletionResponse(id=response_id, model=model, choices=[], usage=usage)


def _chunk_choice(
    engine: AsyncEngine, index: int, delta: Delta, text_offsets: dict[int, int]
) -> CompletionChoice:
    logprobs = None
    if delta.logprobs is not None:
        logprobs = completion_logprobs(
            engine.tokenizer, delta.token_ids, delta.logprobs, text_offsets[index]
        )
        text_offsets[index] += sum(len(token) for token in logprobs.tokens)
    return CompletionChoice(
        index=index,
        text=delta.text,
        logprobs=logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
    )
