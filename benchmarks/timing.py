"""GPU timing that holds up when the clock drifts: the same kernel runs faster or slower
from one back-to-back run to the next (docs/performance.md, "GPU clock drift"), so kernels
compared one after the other can differ by more than the change being measured. Kernels compared here take turns
over several rounds, and each round's ratio cancels that round's clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import triton

# The H100 SXM's peaks that the benchmarks report fractions of: HBM3 bandwidth, and dense
# tensor-core throughput per operand type.
H100_PEAK_GBPS = 3350.0
H100_PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}


def bench(fn: Callable, warmup: int = 25, rep: int = 100) -> float:
    """fn's median time in ms (warmup and rep are milliseconds of calls)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def wall_ms(fn: Callable) -> float:
    """One call's wall time in ms, for the sweeps' checks under Triton's interpreter on the
    CPU (they go through every step; the times mean nothing)."""
    begin = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - begin)


def interleaved(fns: Sequence[Callable], rounds: int = 5) -> list[list[float]]:
    """Each fn's time in each round, the fns taking turns within a round: [fn][round]. Every
    other round runs them in reverse order, so that no fn always runs first (or last)."""
    times: list[list[float]] = [[] for _ in fns]
    for round_index in range(rounds):
        order = range(len(fns)) if round_index % 2 == 0 else reversed(range(len(fns)))
        for index in order:
            times[index].append(bench(fns[index]))
    return times


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median over rounds of one round's numerator / denominator time."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def graphed(fn: Callable) -> Callable:
    """fn captured in a CUDA graph, as engines run decode steps: timing its replay leaves
    out the host's launch overhead, which otherwise decides a one-sequence step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and allocates outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
