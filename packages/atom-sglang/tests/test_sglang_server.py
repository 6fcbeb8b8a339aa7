"""`python -m sglang.launch_server` with atom-sglang: ATOM's Qwen3 serves HTTP requests.

One server (a start costs 30-45 s here) on a tiny random fp32 Qwen3 with atom.demo's
word-level tokenizer (SGLang's /v1/completions needs one; /generate takes token ids
either way). `sglang_cpu_support.engine_env` puts the CPU workarounds into every server
process (the HTTP front end, the scheduler, the detokenizer). Greedy token ids over
/generate and /v1/completions equal HF transformers'; a bad request gets a 400 and the
server goes on serving; the server log shows that ATOM's model and backend did the work.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import requests
from sglang_cpu_support import engine_env
from sglang_harness import ENGINE, MAX_TOKENS

from atom.demo import build_tokenizer
from atom.registry import get_entry
from atom.testing import VOCAB, hf_greedy, random_prompts, wait_healthy, write_host_checkpoint

pytestmark = pytest.mark.slow

ARCH = "Qwen3ForCausalLM"
PROMPTS = random_prompts([5, 17, 40], seed=31)
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
# The harness's engine settings, with a tokenizer: /v1/completions detokenizes its output.
SERVER = {**ENGINE, "skip_tokenizer_init": False, "attention_backend": "atom"}


def server_flags(settings: dict) -> list[str]:
    """Engine keyword arguments as `launch_server` flags (True: a bare flag)."""
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its scheduler and detokenizer too)."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sglang-server")
    model = write_host_checkpoint(ARCH, workdir / "model")
    build_tokenizer(VOCAB).save_pretrained(model)
    port = free_port()
    env = engine_env(workdir)
    for name in ("ATOM_DISABLE_SGLANG_PLUGIN", "SGLANG_EXTERNAL_MODEL_PACKAGE"):
        env.pop(name, None)
    env["PYTHONHASHSEED"] = "0"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--host", "127.0.0.1", "--port", str(port), *server_flags(SERVER)]  # fmt: skip
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log_path)
        yield base, str(model), log_path
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def expected(server) -> list[list[int]]:
    return hf_greedy(server[1], PROMPTS, MAX_TOKENS)


def generate(base: str, input_ids, sampling_params: dict) -> requests.Response:
    body = {"input_ids": input_ids, "sampling_params": sampling_params}
    return requests.post(f"{base}/generate", json=body, timeout=120)


def test_generate_token_ids_equal_hf(server, expected):
    base, _, _ = server
    reply = generate(base, PROMPTS, GREEDY)
    assert reply.status_code == 200, reply.text
    assert [out["output_ids"] for out in reply.json()] == expected


def test_openai_completions_token_ids_equal_hf(server, expected):
    base, model, _ = server
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    for prompt, want in zip(PROMPTS, expected):
        reply = requests.post(
            f"{base}/v1/completions", json={**body, "prompt": prompt}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        assert choice["token_ids"] == want


def test_invalid_request_gets_400_and_server_keeps_serving(server, expected):
    base, model, _ = server
    reply = generate(base, PROMPTS[0], {**GREEDY, "max_new_tokens": -1})
    assert reply.status_code == 400
    assert "max_new_tokens must be at least 0" in reply.text
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": -3}
    reply = requests.post(f"{base}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert "max_tokens must be positive" in reply.text

    reply = generate(base, PROMPTS[0], GREEDY)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output_ids"] == expected[0]


def test_log_shows_atom_model_and_backend(server):
    base, _, log_path = server
    generate(base, PROMPTS[:1], GREEDY).raise_for_status()  # at least one forward
    log = log_path.read_text()
    entry = get_entry(ARCH)
    assert f"ATOM {ARCH} ({entry.class_path}) built for SGLang: 2 {entry.attention}" in log
    assert "ATOM attention backend: MHA pool" in log
    assert "ATOM attention backend: first attention call" in log
