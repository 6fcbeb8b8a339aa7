"""Runs the LLMEngine in one background thread and hands its outputs to asyncio.

The engine is not thread-safe, so everything that touches it (add, abort, step, stats)
runs on that thread: the event loop posts commands to a queue and awaits their futures;
outputs go back through each call's OutputStream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from atom.engine.llm_engine import EngineStats, LLMEngine
from atom.sampling_params import SamplingParams
from atom.server.metrics import ServingMetrics
from atom.server.options import DEFAULT_MAX_UNREAD_TOKENS
from atom.server.output_stream import OutputStream

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class OutputBacklogError(RuntimeError):
    """A streaming call was aborted because its client left too much output unread."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS):
        """max_unread_tokens: how many output tokens (over its choices) a streaming call's
        client may leave unread before the call is aborted; bounds what a stalled reader
        costs."""
        self.engine = engine
        self.max_unread_tokens = max_unread_tokens
        self._stats = engine.stats()
        self._commands: queue.SimpleQueue[tuple[Future, Callable, tuple]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        # Owned by the engine thread: live request id -> its stream; the metrics it feeds.
        self._streams: dict[str, OutputStream] = {}
        self._metrics: list[ServingMetrics] = []
        self._thread = threading.Thread(target=self._run, name="atom-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.hf_config.vocab_size

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's stats after its latest step or command (read without waiting for it)."""
        return self._stats

    def add_metrics(self, metrics: ServingMetrics) -> None:
        """Feeds `metrics` every request's progress from now on."""
        self._post(self._metrics.append, metrics)

    async def submit(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        arrival_time: float | None = None,
        deltas: bool = False,
    ) -> OutputStream:
        """Adds one engine request per prompt; raises the engine's ValueError for a bad one.
        arrival_time: `time.monotonic()` when the request arrived (default: when the engine
        takes it). deltas: the stream yields each step's OutputDelta (for a streaming
        response), else only each request's final output."""
        stream = OutputStream(len(prompts), params, deltas)
        add = self._post(self._add, stream, prompts, params, arrival_time)
        try:
            await asyncio.wrap_future(add)
        except asyncio.CancelledError:
            self.abort(stream)  # the add may have run before the cancellation reached it
            raise
        return stream

    def abort(self, stream: OutputStream) -> None:
        """Frees the unfinished requests of `stream`; returns at once, safe to repeat."""
        if not stream.finished:
            self._post(self._abort, stream)

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join()

    def _post(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._commands.put((future, fn, args))
        self._wakeup.set()
        return future

    # The engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._run_commands()
            if self.engine.has_unfinished_requests():
                self._step()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                future, fn, args = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it ran
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)

    def _add(
        self,
        stream: OutputStream,
        prompts: list[Prompt],
        params: SamplingParams,
        arrival_time: float | None,
    ) -> None:
        added: list[str] = []
        try:
            for request_id, prompt in zip(stream.request_ids, prompts):
                self.engine.add_request(prompt, params, request_id, arrival_time)
                added.append(request_id)
        except ValueError as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
            if len(prompts) == 1:
                raise
            raise ValueError(f"prompt {len(added)}: {exc}") from exc
        for request_id in added:
            self._streams[request_id] = stream
        for metrics in self._metrics:
            metrics.added(added)

    def _abort(self, stream: OutputStream) -> None:
        aborted = [r for r in stream.request_ids if self._streams.pop(r, None) is not None]
        for request_id in aborted:
            self.engine.abort_request(request_id)
        for metrics in self._metrics:
            metrics.aborted(aborted)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # Fail the requests in flight but keep serving: the next request may well work.
            logger.exception("engine step failed; aborting %d requests", len(self._streams))
            for request_id in self._streams:
                self.engine.abort_request(request_id)
            for metrics in self._metrics:
                metrics.aborted(list(self._streams))
            for stream in set(self._streams.values()):
                stream.push(exc)
            self._streams.clear()
            return
        for output in outputs:
            # Recorded before the client can see the output: a client that has its
            # response finds it in /metrics.
            for metrics in self._metrics:
                metrics.output(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted earlier in this loop: its client stopped reading
            if output.finished:
                del self._streams[output.request_id]
            stream.push(output)
            if stream.unread_tokens > self.max_unread_tokens:
                self._abort_backlogged(stream)

    def _abort_backlogged(self, stream: OutputStream) -> None:
        unread = stream.unread_tokens
        logger.warning(
            "aborting request %s: its client left %d output tokens unread, more than "
            "--max-unread-tokens %d",
            stream.call_id,
            unread,
            self.max_unread_tokens,
        )
        self._abort(stream)
        stream.push(OutputBacklogError(f"aborted: {unread} output tokens were left unread"))
