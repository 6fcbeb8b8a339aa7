"""Server-sent events: cumulative engine outputs become per-choice deltas, then SSE lines."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from atom.engine.outputs import CompletionOutput, Logprobs
from atom.sampling_params import SamplingParams
from atom.server.async_engine import AsyncEngine
from atom.server.errors import error_body
from atom.server.output_stream import OutputStream

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    is_first: bool
    first_token: int  # the index of token_ids[0] in the whole completion


class DeltaTracker:
    """What one choice has sent so far.

    With stop strings, the last len(longest stop) - 1 characters are held back while the
    choice runs: they may be the start of a stop string, which the final text drops.
    """

    def __init__(self, params: SamplingParams):
        self.holdback = max((len(stop) for stop in params.stop), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0
        self.started = False
        self.done = False

    def advance(self, completion: CompletionOutput) -> Delta | None:
        """The delta since the last call, or None when there is nothing worth a chunk."""
        if self.done:
            return None
        finished = completion.finish_reason is not None
        end = len(completion.text) if finished else len(completion.text) - self.holdback
        text = completion.text[self.sent_chars : max(end, self.sent_chars)]
        # The engine appends to its logprobs list in place, so cut it at the tokens seen here.
        num_tokens = len(completion.token_ids)
        logprobs = completion.logprobs
        if logprobs is not None:
            logprobs = logprobs[self.sent_tokens : num_tokens]
        if not (text or finished or logprobs):
            return None
        delta = Delta(
            text,
            completion.token_ids[self.sent_tokens : num_tokens],
            logprobs,
            completion.finish_reason,
            completion.stop_reason,
            is_first=not self.started,
            first_token=self.sent_tokens,
        )
        self.sent_chars += len(text)
        self.sent_tokens = num_tokens
        self.started, self.done = True, finished
        return delta


def event_stream(
    engine: AsyncEngine, stream: OutputStream, chunks: AsyncIterator[BaseModel]
) -> StreamingResponse:
    """An SSE response of `chunks` ending in `[DONE]`; its engine requests are aborted
    when it ends early (client gone) or its body never ran."""
    return StreamingResponse(
        _sse_lines(chunks),
        media_type="text/event-stream",
        background=BackgroundTask(engine.abort, stream),
    )


async def _sse_lines(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as exc:
        # The 200 status is already sent, so the error travels in the stream.
        logger.exception("stream failed")
        yield f"data: {error_body(str(exc), 'internal_server_error').model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"
