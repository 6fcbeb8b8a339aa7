"""The steps every generating endpoint shares: build the params, submit, collect."""

from __future__ import annotations

from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.async_engine import AsyncEngine, Prompt
from atom.server.errors import APIError
from atom.server.output_stream import OutputStream
from atom.server.protocol import SamplingRequest, Usage


def sampling_params_of(request: SamplingRequest) -> SamplingParams:
    try:
        return request.sampling_params()
    except ValueError as exc:  # SamplingParamsError names the field
        raise APIError(400, str(exc)) from exc


async def submit(
    engine: AsyncEngine, prompts: list[Prompt], params: SamplingParams, param: str
) -> OutputStream:
    """Submits; a prompt the engine refuses (empty, too long, bad ids) becomes a 400."""
    try:
        return await engine.submit(prompts, params)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc


async def final_outputs(engine: AsyncEngine, stream: OutputStream) -> list[RequestOutput]:
    """Each prompt's finished output, in prompt order; aborts the requests if cancelled."""
    last: dict[int, RequestOutput] = {}
    try:
        async for output in stream:
            last[stream.prompt_index(output)] = output
    finally:
        engine.abort(stream)  # a no-op once every request has finished
    return [last[i] for i in sorted(last)]


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
