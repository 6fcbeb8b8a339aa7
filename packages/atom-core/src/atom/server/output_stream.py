"""The outputs of one API call, handed from the engine thread to the event loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import uuid

from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.deltas import DeltaTracker, OutputDelta


class OutputStream:
    """Async iterator over the outputs of one API call's engine requests (one per prompt).

    Created on the event loop; the engine thread feeds it through `push`, which is
    thread-safe. A streaming call gets one OutputDelta per step (one chunk each, as the
    client sees them); `unread_tokens` counts the tokens of those waiting. Any other call
    gets only each request's final RequestOutput. Iteration ends once every request has sent its finished output.
    """

    def __init__(self, num_prompts: int, params: SamplingParams, deltas: bool):
        self.call_id = uuid.uuid4().hex
        self.request_ids = [f"{self.call_id}-{i}" for i in range(num_prompts)]
        self._prompt_index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        self._unfinished = set(self.request_ids)
        self._trackers = {r: DeltaTracker(params) for r in self.request_ids} if deltas else None
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._lock = threading.Lock()  # guards what follows, shared by both threads
        self._waiting: collections.deque[OutputDelta | RequestOutput] = collections.deque()
        self._error: BaseException | None = None
        self.unread_tokens = 0

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def prompt_index(self, output: OutputDelta | RequestOutput) -> int:
        return self._prompt_index[output.request_id]

    def push(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread: an output, or the error that ended the requests
        (it drops what was waiting: nobody will read it)."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = item
                self._waiting.clear()
                self.unread_tokens = 0
            elif self._trackers is None:
                if not item.finished:
                    return
                self._waiting.append(item)
            else:
                delta = self._trackers[item.request_id].advance(item)
                if delta is None:
                    return
                self.unread_tokens += delta.num_tokens
                self._waiting.append(delta)
        # RuntimeError: the event loop has closed (server shutdown), nobody is left to read.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._ready.set)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> OutputDelta | RequestOutput:
        while not self.finished:
            with self._lock:
                if self._error is not None:
                    self._unfinished.clear()
                    raise self._error
                if self._waiting:
                    item = self._waiting.popleft()
                    if isinstance(item, OutputDelta):
                        self.unread_tokens -= item.num_tokens
                    if item.finished:
                        self._unfinished.discard(item.request_id)
                    return item
                self._ready.clear()
            await self._ready.wait()
        raise StopAsyncIteration
