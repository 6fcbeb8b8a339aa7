"""From per-request timings to the figures of one run (one workload at one rate).

TTFT: send -> first output chunk. TPOT: (latency - TTFT) / (output tokens - 1), one value
per request, so a request's wait for its first token does not dilute its decode speed.
ITL: every gap between output chunks of every request, pooled. Throughputs divide by the
run's wall time (first send to last completion). Goodput counts only the requests that
met every SLO given, per second.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from atom.bench.serve.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, interpolating linearly between the closest ranks (numpy's
    default), so p50 of an even count is the mean of the middle two."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None for a single-token output."""
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def meets(result: RequestResult, slo: Slo) -> bool:
    """Whether a completed request met every SLO that is set (TPOT: vacuously for one token)."""
    if slo.ttft_ms is not None and result.ttft * 1e3 > slo.ttft_ms:
        return False
    per_token = tpot(result)
    return slo.tpot_ms is None or per_token is None or per_token * 1e3 <= slo.tpot_ms


def distribution_ms(seconds: list[float]) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds; None when there is nothing to describe."""
    if not seconds:
        return None
    ms = [s * 1e3 for s in seconds]
    return {"mean": statistics.fmean(ms)} | {f"p{q}": percentile(ms, q) for q in PERCENTILES}


def summarize(results: list[RequestResult], duration_s: float, slo: Slo) -> dict:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return dict(
        requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        errors=sorted({r.error for r in results if not r.ok})[:3],
        short_outputs=sum(r.output_tokens != r.expected_output_len for r in done),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=sum(meets(r, slo) for r in done) / duration_s if slo.given else None,
        ttft_ms=distribution_ms([r.ttft for r in done]),
        tpot_ms=distribution_ms([t for r in done if (t := tpot(r)) is not None]),
        itl_ms=distribution_ms([gap for r in done for gap in r.itl]),
        e2el_ms=distribution_ms([r.latency for r in done]),
    )
