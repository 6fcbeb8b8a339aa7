"""A streaming client that stops reading costs a bounded buffer: once it leaves more than
--max-unread-tokens output tokens unread its request is aborted with a logged reason, its
KV blocks come back, and the server goes on serving everyone else."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.byte_level_model import write_byte_level_model
from tests.server.server_process import MODEL, running_server, scrape_metrics, wait_until_idle

MAX_UNREAD_TOKENS = 256
N, MAX_TOKENS, READ_TOKENS = 8, 900, 200
# Enough KV blocks for all N choices at full length: only the unread bound can stop them.
OPTIONS = {"dtype": "float32", "block_size": 16, "num_blocks": N * 64, "max_num_seqs": 16}
ABORTED = 'atom:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, server log)."""
    folder = write_byte_level_model(tmp_path_factory.mktemp("byte-level"))
    log = folder / "server.log"
    options = {"served_model_name": MODEL, "log_level": "warning",
               "max_unread_tokens": MAX_UNREAD_TOKENS, **OPTIONS}  # fmt: skip
    with running_server(str(folder), log=log, **options) as url:
        yield url, log


def chat(max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "n": N,
            "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 20,
            "ignore_eos": True}  # fmt: skip


def stalled_stream(url: str) -> socket.socket:
    """Sends a long streaming chat with n choices and 20 top logprobs (about 1 KB per token)
    and never reads the answer. The kernel soaks up the first few MB in the reader's place
    (the server's send buffer grows to 4 MB); a small receive buffer keeps it to that."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    body = json.dumps({**chat(MAX_TOKENS), "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    sock.sendall(head + body)
    return sock


def test_stalled_reader_is_aborted_and_its_memory_returned(served):
    url, log = served
    sock = stalled_stream(url)
    try:
        deadline = time.monotonic() + 120
        while scrape_metrics(url).get(ABORTED, 0) < 1:
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            time.sleep(0.2)
        idle = wait_until_idle(url)  # every KV block is free again
        assert idle["atom:generation_tokens_total"] < N * MAX_TOKENS
        assert "output tokens unread, more than --max-unread-tokens 256" in log.read_text()
    finally:
        sock.close()


def test_a_reading_client_of_a_long_stream_gets_it_all(served):
    """Many times --max-unread-tokens, read as it comes: the bound never trips."""
    url, _ = served
    aborted = scrape_metrics(url)[ABORTED]
    body = {**chat(READ_TOKENS), "stream": True}
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += len(choice["logprobs"]["content"])
    assert tokens == N * READ_TOKENS and scrape_metrics(url)[ABORTED] == aborted
