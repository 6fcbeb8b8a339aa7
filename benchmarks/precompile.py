"""Compile many launch configs of Triton kernels in parallel, into Triton's on-disk cache.

A Triton compile takes seconds and a process compiles one kernel at a time, so a tuner that
times a hundred configs spends most of its time compiling. Instead, a pool of spawned
processes (CUDA does not survive a fork) runs each config once; the tuning process then times
them with every kernel a cache hit. The workers build their own inputs: give them the same
shapes as the timed run, or the cache keys (which see the arguments' shapes and alignment)
differ and the tuner compiles again.

A worker whose config fails, or dies, is replaced by a fresh process before it takes another:
a kernel that faults leaves its process's CUDA context unusable, and a broken worker that
kept taking configs would fail fast through the rest of the queue. Each job ends with a
synchronize, so that its kernels' fault is its own error, not the next job's.

    with worker_pool() as pool:
        ok = precompile(run_one_config, configs, pool)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait


def progress(label: str, done: int, total: int, every: int = 16) -> None:
    if done % every == 0 or done == total:
        print(f"  {label} {done}/{total}", flush=True)


def describe_error(exc: Exception) -> str:
    """The error's type and the first line of its message (compiler errors run to pages)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _wait_for_gpu() -> None:
    """Waits for the kernels the job queued, where it used CUDA (they run asynchronously)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _runs(fn: Callable, item) -> str | None:
    """None when fn(item) ran to completion on the GPU too, else why not (describe_error)."""
    try:
        fn(item)
        _wait_for_gpu()
    except Exception as exc:  # does not compile, or does not fit this GPU: the tuner skips it
        return describe_error(exc)
    return None


def _serve(conn: Connection) -> None:
    """A worker: runs (fn, item) jobs and sends back _runs' answer until the pool closes the
    pipe, or a job fails (its CUDA context may be broken: the pool starts a fresh process)."""
    with contextlib.suppress(EOFError):
        while True:
            error = _runs(*conn.recv())
            conn.send(error)
            if error is not None:
                return


class WorkerPool:
    """Spawned workers, kept for several precompile calls (each one starts in seconds: it
    imports torch and opens a CUDA context)."""

    def __init__(self, size: int):
        self._context = multiprocessing.get_context("spawn")
        self._idle = [self._start() for _ in range(size)]
        self._busy: dict[Connection, tuple[multiprocessing.Process, int]] = {}

    def _start(self) -> tuple[multiprocessing.Process, Connection]:
        conn, child_conn = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child_conn,), daemon=True)
        process.start()
        child_conn.close()
        return process, conn

    def run(self, fn: Callable, items: Sequence) -> Iterator[tuple[int, str | None]]:
        """(index, _runs' answer) for every item, in the order they finish."""
        todo = list(enumerate(items))[::-1]
        try:
            while todo or self._busy:
                while todo and self._idle:
                    process, conn = self._idle.pop()
                    index, item = todo.pop()
                    conn.send((fn, item))
                    self._busy[conn] = process, index
                for conn in wait(list(self._busy)):
                    process, index = self._busy.pop(conn)
                    try:
                        error = conn.recv()
                    except (EOFError, ConnectionResetError):  # it crashed (a segfault, say)
                        process.join()
                        error = f"worker died (exit code {process.exitcode})"
                    if error is None:
                        self._idle.append((process, conn))
                    else:
                        self._stop(process, conn)
                        self._idle.append(self._start())
                    yield index, error
        finally:  # the caller stopped early: answers still due would reach the next run, and
            # nobody waits for them (a compile can take many seconds), so their workers go
            for conn, (process, _) in self._busy.items():
                process.kill()
                self._stop(process, conn)
                self._idle.append(self._start())
            self._busy.clear()

    @staticmethod
    def _stop(process: multiprocessing.Process, conn: Connection) -> None:
        conn.close()  # an idle worker's recv ends: it exits
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()

    def close(self) -> None:
        for process, conn in [*self._idle, *((p, c) for c, (p, _) in self._busy.items())]:
            self._stop(process, conn)
        self._idle, self._busy = [], {}

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def worker_pool(workers: int | None = None) -> WorkerPool:
    return WorkerPool(workers or min(16, os.cpu_count() or 1))


def precompile(
    fn: Callable, items: Sequence, pool: WorkerPool, label: str = "compiled"
) -> list[bool]:
    """Runs fn(item) for every item in the pool's workers; returns, per item, whether it ran,
    and prints how many failed with each error. fn must be a module-level function and the
    items picklable."""
    errors: list[str | None] = [None] * len(items)
    for done, (index, error) in enumerate(pool.run(fn, items), 1):
        errors[index] = error
        progress(label, done, len(items))
    for error, count in Counter(e for e in errors if e is not None).most_common():
        print(f"  {label}: {count} failed with {error}", flush=True)
    return [error is None for error in errors]
