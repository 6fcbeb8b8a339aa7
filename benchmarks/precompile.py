"""Compile many launch configs of Triton kernels in parallel, into Triton's on-disk cache.

A Triton compile takes seconds and a process compiles one kernel at a time, so a tuner that
times a hundred configs spends most of its time compiling. Instead, a pool of spawned
processes (CUDA does not survive a fork) runs each config once; the tuning process then times
them with every kernel a cache hit. The workers build their own inputs: give them the same
shapes as the timed run, or the cache keys (which see the arguments' shapes and alignment)
differ and the tuner compiles again.

    with worker_pool() as pool:
        ok = precompile(run_one_config, configs, pool)
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed


def worker_pool(workers: int | None = None) -> ProcessPoolExecutor:
    """Spawned workers, kept for several precompile calls (each one starts in seconds: it
    imports torch and opens a CUDA context)."""
    workers = workers or min(16, os.cpu_count() or 1)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def progress(label: str, done: int, total: int, every: int = 16) -> None:
    if done % every == 0 or done == total:
        print(f"  {label} {done}/{total}", flush=True)


def _runs(fn: Callable, item) -> str | None:
    """None when fn(item) ran, else why not: the error's type and first line."""
    try:
        fn(item)
    except Exception as exc:  # does not compile, or does not fit this GPU: the tuner skips it
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"
    return None


def precompile(
    fn: Callable, items: Sequence, pool: ProcessPoolExecutor, label: str = "compiled"
) -> list[bool]:
    """Runs fn(item) for every item in the pool's workers; returns, per item, whether it ran,
    and prints how many failed with each error. fn must be a module-level function and the
    items picklable."""
    futures = [pool.submit(_runs, fn, item) for item in items]
    for done, _ in enumerate(as_completed(futures), 1):
        progress(label, done, len(futures))
    errors = [future.result() for future in futures]
    for error, count in Counter(e for e in errors if e is not None).most_common():
        print(f"  {label}: {count} failed with {error}", flush=True)
    return [error is None for error in errors]
