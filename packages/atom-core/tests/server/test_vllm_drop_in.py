"""`atom serve` takes a `vllm serve` command line: vLLM's flags with vLLM's meaning, its API
key variable, and vLLM's 400 for a max_tokens beyond the context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import atom
from atom.server.tool_calls import TOOL_CALL_PARSERS
from tests.server.server_process import MODEL, free_port

GREEDY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12,
          "extra_body": {"ignore_eos": True}}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_style_server(checkpoint, tmp_path_factory):
    """`atom serve` started as `vllm serve` is, with the key in VLLM_API_KEY; yields its
    URL and its log."""
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5})
    )
    log, port = folder / "serve.log", free_port()
    command = [sys.executable, "-m", "atom.cli", "serve", str(checkpoint), "--port", str(port),
               "--served-model-name", MODEL, "--dtype", "float32", "--seed", "7",
               "--generation-config", str(folder), "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--uvicorn-log-level", "warning",
               "--trust-remote-code"]  # fmt: skip
    src = str(Path(atom.__file__).parents[1])
    env = {**os.environ, "VLLM_API_KEY": "secret", "PYTHONPATH": src}
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=output)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while not healthy(url):
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
            yield url, log
        finally:
            process.terminate()
            process.wait(timeout=30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_vllm_flags_and_api_key_variable(vllm_style_server, client):
    url, log = vllm_style_server
    assert httpx.get(f"{url}/v1/models").status_code == 401
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
    # --generation-config's temperature 0 is the default of a request that gives none.
    greedy = client.completions.create(**GREEDY, temperature=0).choices[0].text
    assert keyed.completions.create(**GREEDY).choices[0].text == greedy
    # Its max_new_tokens is the length limit of a request that sets none, as vLLM's.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    assert keyed.chat.completions.create(**chat).usage.completion_tokens == 5
    assert keyed.chat.completions.create(**chat, max_tokens=7).usage.completion_tokens == 7
    unset = {**GREEDY, "max_tokens": None}
    assert keyed.completions.create(**unset).usage.completion_tokens == 5
    lines = log.read_text().splitlines()
    assert sum("--trust-remote-code has no effect" in line for line in lines) == 1


def test_unknown_tool_call_parser_is_a_one_line_startup_error(checkpoint):
    command = [sys.executable, "-m", "atom.cli", "serve", str(checkpoint), "--port",
               str(free_port()), "--tool-call-parser", "nonesuch"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(atom.__file__).parents[1])}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "atom serve: error: --tool-call-parser 'nonesuch' is not one ATOM has; it has: "
        + ", ".join(TOOL_CALL_PARSERS)
    )
    assert "qwen3_coder" in TOOL_CALL_PARSERS


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_beyond_the_context_is_a_400(server, field):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], field: 100_000}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] | {"message": None} == {
        "message": None, "type": "invalid_request_error", "param": field, "code": None}  # fmt: skip
    assert response.json()["error"]["message"] == (
        f"{field}=100000 cannot be greater than max_model_len=256. Please request fewer "
        "output tokens."
    )
