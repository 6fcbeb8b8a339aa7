"""Server-sent events: a streaming response's chunks as SSE lines, ending in [DONE]."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from atom.server.async_engine import AsyncEngine, OutputBacklogError
from atom.server.errors import error_body
from atom.server.output_stream import OutputStream

logger = logging.getLogger(__name__)


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
    except OutputBacklogError as exc:  # logged with its reason when the engine aborted it
        yield f"data: {error_body(str(exc), 'output_backlog').model_dump_json()}\n\n"
    except Exception as exc:
        # The 200 status is already sent, so the error travels in the stream.
        logger.exception("stream failed")
        yield f"data: {error_body(str(exc), 'internal_server_error').model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"
