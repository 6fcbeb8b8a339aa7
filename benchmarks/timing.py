"""GPU timing that holds up when the clock drifts: an H200 ran the same kernel up to 15%
faster or slower from one back-to-back run to the next, so kernels compared one after the
other can differ by that much. Kernels compared here take turns over several rounds, and
each round's ratio cancels that round's clock."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import triton


def bench(fn: Callable, warmup: int = 25, rep: int = 100) -> float:
    """fn's median time in ms (warmup and rep are milliseconds of calls)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def interleaved(fns: Sequence[Callable], rounds: int = 5) -> list[list[float]]:
    """Each fn's time in each round, the fns taking turns within a round: [fn][round]."""
    per_round = [[bench(fn) for fn in fns] for _ in range(rounds)]
    return [list(times) for times in zip(*per_round)]


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median over rounds of one round's numerator / denominator time."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))
