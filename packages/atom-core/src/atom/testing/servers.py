"""Waiting for an HTTP server that a test started in a subprocess (ATOM's, vLLM's, SGLang's)."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

LOG_TAIL = 6000


class ServerFailed(AssertionError):
    """The server exited or never answered; the message ends with its log."""


def wait_healthy(
    proc: subprocess.Popen, base_url: str, log_path: Path, timeout: float = 300
) -> None:
    """Returns once `GET {base_url}/health` answers 200; raises ServerFailed with the end
    of the server's log if the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerFailed(
                f"server exited with {proc.returncode}:\n{log_path.read_text()[-LOG_TAIL:]}"
            )
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise ServerFailed(
                f"server not healthy after {timeout:.0f} s:\n{log_path.read_text()[-LOG_TAIL:]}"
            )
        time.sleep(1)
