"""The steps every generating endpoint shares: check, tokenize, submit, collect."""

from __future__ import annotations

import re

from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.context import ServerContext
from atom.server.errors import APIError
from atom.server.output_stream import OutputStream
from atom.server.protocol import SamplingRequest
from atom.server.responses import Usage


def sampling_params_of(request: SamplingRequest) -> SamplingParams:
    try:
        return request.sampling_params()
    except ValueError as exc:  # SamplingParamsError names the field
        raise APIError(400, str(exc), param=re.match(r"\w*", str(exc))[0] or None) from exc


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
    ctx: ServerContext, prompts: list[list[int]], params: SamplingParams, param: str
) -> OutputStream:
    """Submits; a prompt the engine refuses (empty, too long, bad ids) becomes a 400."""
    try:
        return await ctx.engine.submit(prompts, params)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc


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
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
