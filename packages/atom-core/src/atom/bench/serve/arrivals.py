"""When each request is sent: a Poisson process of a given rate, or all at once."""

from __future__ import annotations

import math
import random

from atom.bench.workloads import BenchError


def poisson_arrivals(count: int, rate: float, seed: str) -> list[float]:
    """Send times in seconds from the start of a run: the first at 0, then gaps drawn from
    an exponential of mean 1/rate (so arrivals form a Poisson process of `rate` per
    second). An infinite rate sends everything at 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals:{seed}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def parse_rates(text: str) -> list[float]:
    """'1,4,16,inf' -> [1.0, 4.0, 16.0, inf] (requests per second), in the given order."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--rates {text!r}: comma-separated numbers or inf") from None
    if not rates or any(not r > 0 or math.isnan(r) for r in rates):
        raise BenchError(f"--rates {text!r}: every rate must be > 0 (inf: all at once)")
    if len(set(rates)) != len(rates):
        raise BenchError(f"--rates {text!r} repeat one")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
