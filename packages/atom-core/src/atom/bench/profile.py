"""`atom bench --profile`: where one timed generation spends its time, per engine.

Every engine records a torch-profiler chrome trace of the timed generation: ATOM and
vLLM in the driver process (vLLM runs its engine core in-process for it), SGLang in its
scheduler process through its own profiling requests. `summarize` reads any such trace
and answers the first question of a throughput gap: is the GPU busy (then which kernels
take the time) or waiting for the host (then the launch count and the idle share say
how much the CPU side costs).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

TOP_KERNELS = 25
TOP_HOST_RANGES = 20


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy


def _ranked(
    what: str, durations: dict[str, list[float]], top: int, total: float | None = None
) -> list[str]:
    """Table rows of the `top` names by total time (with each one's share of `total` when
    given), then one row for the rest."""
    share = (lambda t: f"{t / total:>6.1%}") if total else (lambda t: f"{'':>6}")
    rows = [
        f"{what:<90} {'calls':>8} {'total ms':>10} {'share' if total else '':>6} {'mean us':>9}"
    ]
    ranked = sorted(durations.items(), key=lambda kv: -sum(kv[1]))
    for name, times in ranked[:top]:
        t = sum(times)
        short = name if len(name) <= 90 else name[:87] + "..."
        rows.append(
            f"{short:<90} {len(times):>8,} {t / 1e3:>10,.2f} {share(t)} {t / len(times):>9,.1f}"
        )
    rest = ranked[top:]
    if rest:
        t = sum(sum(times) for _, times in rest)
        label = f"({len(rest)} other {what}s)"
        rows.append(f"{label:<90} {'':>8} {t / 1e3:>10,.2f} {share(t)}")
    return rows


def summarize(paths: list[Path]) -> str:
    """A text report of the kernels in one run's trace files (one file per process)."""
    kernels: dict[str, list[float]] = defaultdict(list)
    host_ranges: dict[str, list[float]] = defaultdict(list)
    intervals: list[tuple[float, float]] = []
    launches = graph_launches = 0
    for path in paths:
        for e in _events(path):
            if e.get("ph") != "X":
                continue
            cat, name = e.get("cat", ""), e.get("name", "")
            if cat == "kernel":
                kernels[name].append(e["dur"])
                intervals.append((e["ts"], e["ts"] + e["dur"]))
            elif cat == "user_annotation":
                host_ranges[name].append(e["dur"])
            elif cat == "cuda_runtime":
                if name.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
                    launches += 1
                elif name.startswith("cudaGraphLaunch"):
                    graph_launches += 1
    if not intervals:
        return "no GPU kernels in the trace (CPU run, or the profiler saw no device)\n"
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = _busy_us(intervals)
    total = sum(sum(d) for d in kernels.values())
    lines = [
        f"GPU span {span / 1e3:,.1f} ms, busy {busy / 1e3:,.1f} ms ({busy / span:.0%}), "
        f"idle {(span - busy) / 1e3:,.1f} ms; kernel launches from the host {launches:,}, "
        f"CUDA graph launches {graph_launches:,}",
        *_ranked("kernel", kernels, TOP_KERNELS, total),
    ]
    if host_ranges:
        # The hosts' named phases (vLLM's model runner, SGLang's scheduler): where the
        # CPU side of each step goes when the GPU waits (inclusive times; ranges nest).
        lines += _ranked("host range", host_ranges, TOP_HOST_RANGES)
    return "\n".join(lines) + "\n"
