"""One real server for all server tests, over the demo's tiny random Llama and its
locally built tokenizer (which has a chat template)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from atom import LLM
from atom.demo import write_demo_model
from tests.server.server_process import MODEL, running_server

ENGINE_KWARGS = {"dtype": "float32", "block_size": 16, "num_blocks": 256}
# Small enough to test from the client side: choices per request, request body bytes.
MAX_N, MAX_BODY_BYTES = 8, 12_000_000


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def server(checkpoint) -> str:
    """The base URL of the running server."""
    options = {
        "served_model_name": MODEL,
        "log_level": "warning",
        "max_n": MAX_N,
        "max_request_body_bytes": MAX_BODY_BYTES,
        **ENGINE_KWARGS,
    }
    with running_server(str(checkpoint), **options) as url:
        yield url


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline(checkpoint) -> LLM:
    """The same model through the offline API, to compare the server's outputs with."""
    return LLM(model=str(checkpoint), **ENGINE_KWARGS)
