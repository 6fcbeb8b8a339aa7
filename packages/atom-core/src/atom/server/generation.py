"""The steps every generating endpoint shares: check, tokenize, submit, collect."""

from __future__ import annotations

import dataclasses
import re

from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.context import ServerContext
from atom.server.deltas import OutputDelta
from atom.server.errors import APIError
from atom.server.guided_protocol import GuideSpec
from atom.server.output_stream import OutputStream
from atom.server.protocol import SamplingRequest
from atom.server.responses import Usage


async def sampling_params_of(
    ctx: ServerContext, request: SamplingRequest, guide: GuideSpec | None
) -> SamplingParams:
    """The request's SamplingParams; with `guide`, compiled into its guide factory."""
    try:
        params = request.sampling_params(ctx.sampling_defaults)
    except ValueError as exc:  # SamplingParamsError names the field
        raise APIError(400, str(exc), param=_field_named(exc)) from exc
    ctx.limits.check_stop(params)
    ctx.limits.check_max_tokens(request, params)
    if guide is not None:
        factory = await ctx.tokenization.offload(ctx.guided.guide_factory, guide)
        params = dataclasses.replace(params, guide_factory=factory)
    if params.stop:
        # Made ready to match here, not on the engine thread, which serves every request.
        await ctx.tokenization.offload(lambda: params.stop_strings)
    return params


def _field_named(exc: ValueError) -> str | None:
    """The SamplingParams field an error message starts with, if any."""
    word = re.match(r"\w*", str(exc))[0]
    return word if word in SamplingParams.__dataclass_fields__ else None


async def tokenized(
    ctx: ServerContext, prompts: list[str | list[int]], param: str
) -> list[list[int]]:
    """Each prompt's token ids; one that cannot fit the context is refused before (by its
    length in characters) and after tokenizing."""
    for prompt in prompts:
        ctx.limits.check_prompt(prompt, param)
    token_ids = await ctx.tokenization.encode(prompts)
    for ids in token_ids:
        ctx.limits.check_prompt(ids, param)
    return token_ids


async def submit(
    ctx: ServerContext,
    prompts: list[list[int]],
    params: SamplingParams,
    param: str,
    arrival_time: float,
    deltas: bool,
) -> OutputStream:
    """Submits; a prompt or parameter the engine refuses (empty, too long, bad ids)
    becomes a 400. arrival_time: `time.monotonic()` when the handler took the request.
    deltas: the stream yields OutputDeltas (a streaming response), else final outputs."""
    try:
        return await ctx.engine.submit(prompts, params, arrival_time, deltas)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_field_named(exc) or param) from exc


async def final_outputs(ctx: ServerContext, stream: OutputStream) -> list[RequestOutput]:
    """Each prompt's finished output, in prompt order; aborts the requests if cancelled."""
    last: dict[int, RequestOutput] = {}
    try:
        async for output in stream:
            last[stream.prompt_index(output)] = output
    finally:
        ctx.engine.abort(stream)  # a no-op once every request has finished
    return [last[i] for i in sorted(last)]


def usage_of(outputs: list[RequestOutput]) -> Usage:
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return _usage(sum(len(o.prompt_token_ids) for o in outputs), completion)


def stream_usage(last_deltas: list[OutputDelta]) -> Usage:
    """The usage of a streaming call from each prompt's last delta."""
    prompt = sum(len(d.prompt_token_ids) for d in last_deltas)
    return _usage(prompt, sum(d.num_output_tokens for d in last_deltas))


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
