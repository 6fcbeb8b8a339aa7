"""Each engine's OpenAI-compatible server as a subprocess: its command line, start, stop.

The servers get the settings the offline driver gives the engines (atom.bench.driver):
the same dtype, context length, memory fraction and seed; SGLang with Triton attention
for its own model and ATOM's backend under the plugin. Extra options per host come from
--atom-args / --vllm-args / --sglang-args.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from atom.bench.driver import engine_dtype
from atom.bench.engines import EngineSpec

STOP_GRACE_S = 30


@dataclass(frozen=True)
class ServerSettings:
    device: str
    max_model_len: int
    gpu_memory_utilization: float
    extra_args: dict[str, str]  # host -> its extra command-line options


def server_command(
    spec: EngineSpec, model: Path, name: str, port: int, settings: ServerSettings
) -> list[str]:
    """The command that serves `model` as `name` on 127.0.0.1:`port`."""
    length = str(settings.max_model_len)
    memory = str(settings.gpu_memory_utilization)
    if spec.host == "atom":
        command = ["-m", "atom.cli", "serve", str(model), "--port", str(port),
                   "--served-model-name", name, "--device", settings.device,
                   "--dtype", engine_dtype(settings.device), "--max-model-len", length]  # fmt: skip
        if settings.device != "cpu":
            command += ["--gpu-memory-utilization", memory]
    elif spec.host == "vllm":
        command = ["-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", name, "--dtype", "bfloat16",
                   "--max-model-len", length, "--gpu-memory-utilization", memory,
                   "--seed", "0"]  # fmt: skip
    else:
        backend = "atom" if spec.plugin else "triton"  # as the offline driver chooses
        command = ["-m", "sglang.launch_server", "--model-path", str(model), "--host",
                   "127.0.0.1", "--port", str(port), "--served-model-name", name,
                   "--attention-backend", backend, "--sampling-backend", "pytorch",
                   "--context-length", length, "--mem-fraction-static", memory,
                   "--random-seed", "0"]  # fmt: skip
    return [sys.executable, *command, *shlex.split(settings.extra_args.get(spec.host, ""))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_process(
    command: list[str], env: dict[str, str], log_path: Path
) -> Iterator[subprocess.Popen]:
    """Runs `command` (output to `log_path`) until the block ends; then SIGTERM, and
    SIGKILL to its whole process group, so no worker (engine cores, TP ranks, compile
    pools) lives on to share the GPU with the next engine."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
