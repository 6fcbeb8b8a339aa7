"""The outputs of one API call, handed from the engine thread to the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from atom.engine.outputs import RequestOutput


class OutputStream:
    """Async iterator over the outputs of one API call's engine requests (one per prompt).

    Created on the event loop; the engine thread feeds it through `push`, which is
    thread-safe. Iteration ends once every request has sent its finished output.
    """

    def __init__(self, num_prompts: int):
        call_id = uuid.uuid4().hex
        self.request_ids = [f"{call_id}-{i}" for i in range(num_prompts)]
        self._prompt_index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        self._unfinished = set(self.request_ids)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def prompt_index(self, output: RequestOutput) -> int:
        return self._prompt_index[output.request_id]

    def push(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread: an output, or the error that ended the requests."""
        # RuntimeError: the event loop has closed (server shutdown), nobody is left to read.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item
