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

import atom

MODEL = "tiny-llama"  # the name the test server serves its model under
STARTUP_TIMEOUT_S = 120
SERVE = (
    "import json, sys; from atom.server import run_server; "
    "run_server(sys.argv[1], port=int(sys.argv[2]), **json.loads(sys.argv[3]))"
)


@contextmanager
def running_server(model: str, **options) -> Iterator[str]:
    """Serves `model` with run_server(**options) until the block ends; yields its base URL."""
    port = _free_port()
    src = str(Path(atom.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, model, str(port), json.dumps(options)], env=env
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


def scrape_metrics(url: str) -> dict[str, float]:
    """Sample name (with its labels) -> value, from GET /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def _free_port() -> int:
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
