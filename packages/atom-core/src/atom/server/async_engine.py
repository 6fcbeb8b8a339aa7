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
from atom.engine.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.server.metrics import ServingCounters
from atom.server.output_stream import OutputStream

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.counters = ServingCounters()
        self._stats = engine.stats()
        self._commands: queue.SimpleQueue[tuple[Future, Callable, tuple]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        # Owned by the engine thread: live request id -> its stream, and tokens counted so far.
        self._streams: dict[str, OutputStream] = {}
        self._counted_tokens: dict[str, int] = {}
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

    async def submit(self, prompts: list[Prompt], params: SamplingParams) -> OutputStream:
        """Adds one engine request per prompt; raises the engine's ValueError for a bad one."""
        stream = OutputStream(len(prompts))
        try:
            await asyncio.wrap_future(self._post(self._add, stream, prompts, params))
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

    def _add(self, stream: OutputStream, prompts: list[Prompt], params: SamplingParams) -> None:
        added: list[str] = []
        try:
            for request_id, prompt in zip(stream.request_ids, prompts):
                self.engine.add_request(prompt, params, request_id)
                added.append(request_id)
        except ValueError as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
            if len(prompts) == 1:
                raise
            raise ValueError(f"prompt {len(added)}: {exc}") from exc
        for request_id in added:
            self._streams[request_id] = stream
        self.counters.requests += len(added)

    def _abort(self, stream: OutputStream) -> None:
        for request_id in stream.request_ids:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self._counted_tokens.pop(request_id, None)
                self.counters.finished["abort"] += 1

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # Fail the requests in flight but keep serving: the next request may well work.
            logger.exception("engine step failed; aborting %d requests", len(self._streams))
            for request_id in self._streams:
                self.engine.abort_request(request_id)
            self.counters.finished["abort"] += len(self._streams)
            for stream in set(self._streams.values()):
                stream.push(exc)
            self._streams.clear()
            self._counted_tokens.clear()
            return
        for output in outputs:
            self._count_tokens(output)
            stream = self._streams[output.request_id]
            if output.finished:
                del self._streams[output.request_id]
                self.counters.finished[output.outputs[0].finish_reason] += 1
            stream.push(output)

    def _count_tokens(self, output: RequestOutput) -> None:
        generated = sum(len(c.token_ids) for c in output.outputs)
        if output.request_id not in self._counted_tokens:
            self.counters.prompt_tokens += len(output.prompt_token_ids)
        self.counters.generation_tokens += generated - self._counted_tokens.get(
            output.request_id, 0
        )
        if output.finished:
            self._counted_tokens.pop(output.request_id, None)
        else:
            self._counted_tokens[output.request_id] = generated
