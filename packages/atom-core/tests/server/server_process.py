"""`atom.server.run_server` in a subprocess on a free port, and a /metrics reader."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

import atom

MODEL = "tiny-llama"  # the name the test server serves its model under
STARTUP_TIMEOUT_S = 120
SERVE = (
    "import json, sys; from atom.server import run_server; "
    "run_server(sys.argv[1], port=int(sys.argv[2]), **json.loads(sys.argv[3]))"
)


@contextmanager
def running_server(model: str, log: Path | None = None, **options) -> Iterator[str]:
    """Serves `model` with run_server(**options) until the block ends; yields its base URL.
    log: a file for the server's output (default: the test's own)."""
    port = free_port()
    src = str(Path(atom.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    output = open(log, "w") if log is not None else None  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, model, str(port), json.dumps(options)],
        env=env,
        stdout=output,
        stderr=output,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        if output is not None:
            output.close()


def scrape_metrics(url: str, model: str = MODEL) -> dict[str, float]:
    """GET /metrics, parsed by `parse_metrics`."""
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text, model)


def parse_metrics(text: str, model: str) -> dict[str, float]:
    """Prometheus text parsed by prometheus_client: sample -> value, a sample written as in
    the text format but without its model_name label, which every sample must carry with
    the value `model`: `atom:request_success_total{finished_reason="abort"}`."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == model, sample
            written = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[f"{sample.name}{{{written}}}" if written else sample.name] = sample.value
    return samples


def wait_until_idle(url: str, timeout_s: float = 20) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits and every KV block is free; returns
    that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(url)
        idle = metrics["atom:num_requests_running"] == metrics["atom:num_requests_waiting"] == 0
        if idle and metrics["atom:kv_cache_usage_perc"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine is not idle after {timeout_s} s: {metrics}")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server did not become healthy within {STARTUP_TIMEOUT_S} s")
