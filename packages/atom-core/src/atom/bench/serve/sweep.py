"""A sweep: every workload at every rate against one server, one result row per pair."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass

import httpx
from tqdm import tqdm

from atom.bench.serve.arrivals import poisson_arrivals, rate_label
from atom.bench.serve.client import RequestResult, send
from atom.bench.serve.metrics import Slo, summarize
from atom.bench.serve.workloads import Request, ServeWorkload
from atom.bench.workloads import BenchError


@dataclass(frozen=True)
class Sweep:
    base_url: str
    model: str
    endpoint: str  # "completions" or "chat"
    workloads: list[ServeWorkload]
    rates: list[float]
    num_prompts: int
    max_concurrency: int | None  # None: no cap
    vocab_size: int
    seed: int
    slo: Slo
    warmup: int  # untimed requests before the first timed run
    timeout_s: float  # the longest a request may wait for its next byte
    api_key: str | None = None  # sent as `Authorization: Bearer` when set

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def settings(self) -> dict:
        """What a result file records: every field, the workloads' length distributions."""
        recorded = asdict(self) | {"rates": [rate_label(r) for r in self.rates]}
        return recorded | {"api_key": "<set>" if self.api_key else None}  # never the key


async def run_requests(
    sweep: Sweep, requests: list[Request], arrivals: list[float], desc: str
) -> tuple[list[RequestResult], float]:
    """Sends each request at its arrival time, at most `max_concurrency` in flight (one
    arriving while the cap is reached waits; its TTFT starts when it is sent). Returns
    the results in request order and the wall time from the start to the last answer."""
    cap = sweep.max_concurrency
    slots = asyncio.Semaphore(cap) if cap else contextlib.nullcontext()
    # httpx's default pool of 100 connections would be a hidden concurrency cap.
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(sweep.timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=sweep.headers) as client:
        with tqdm(total=len(requests), desc=desc, unit="req", dynamic_ncols=True) as bar:
            start = time.perf_counter()

            async def one(request: Request, at: float) -> RequestResult:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with slots:
                    result = await send(
                        client, sweep.base_url, sweep.endpoint, sweep.model, request
                    )
                bar.update(1)
                return result

            results = await asyncio.gather(*map(one, requests, arrivals))
            return list(results), time.perf_counter() - start


def warm_up(sweep: Sweep) -> None:
    """A few untimed requests (graphs, compilations, allocator pools); fails fast with the
    server's answer when none succeeds, e.g. for a parameter the server rejects."""
    if sweep.warmup < 1:
        return
    requests = sweep.workloads[0].requests(sweep.warmup, sweep.vocab_size, seed="warmup")
    results, _ = asyncio.run(run_requests(sweep, requests, [0.0] * len(requests), "warm-up"))
    if not any(r.ok for r in results):
        raise BenchError(f"every warm-up request to {sweep.base_url} failed: {results[0].error}")


def run_point(sweep: Sweep, workload: ServeWorkload, rate: float) -> dict:
    """One workload at one rate. Each rate draws its own prompts, so a rate does not find
    its prompts in the prefix cache of the rate before."""
    count = workload.num_prompts or sweep.num_prompts
    rate_name = rate_label(rate)
    seed = f"{sweep.seed}:{rate_name}"
    requests = workload.requests(count, sweep.vocab_size, seed)
    arrivals = poisson_arrivals(count, rate, f"{seed}:{workload.name}")
    desc = f"{workload.name} @ {rate_name} req/s"
    results, duration = asyncio.run(run_requests(sweep, requests, arrivals, desc))
    return dict(
        workload=workload.name,
        rate=rate_name,
        max_concurrency=sweep.max_concurrency,
        endpoint=sweep.endpoint,
    ) | summarize(results, duration, sweep.slo)


def run_sweep(sweep: Sweep) -> list[dict]:
    warm_up(sweep)
    return [run_point(sweep, w, rate) for w in sweep.workloads for rate in sweep.rates]
