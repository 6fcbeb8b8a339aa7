"""Cancels a non-streaming request's work when its client goes away.

Streaming responses need none of this: Starlette cancels a stream whose client left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Awaits `work`, or cancels it (and returns None) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.wait((work_task,))  # let its cleanup (the engine abort) run
    return None if work_task.cancelled() else work_task.result()


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
