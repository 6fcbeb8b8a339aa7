"""Clients that go away mid-request get their requests aborted: their sequences and KV
blocks are freed while the other requests run to their full length."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from atom.demo import WORDS
from tests.server.server_process import MODEL, scrape_metrics, wait_until_idle

NUM_STREAMS, NUM_LEAVING = 50, 10
FULL_TOKENS, LEAVING_TOKENS = 20, 200  # a leaving client's request would run long
ABORTED = 'atom:request_success_total{finished_reason="abort"}'


async def full_stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[int, str | None, str]:
    """Reads a stream to its end: (completion tokens, finish reason, text)."""
    chunks = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=FULL_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, reason, usage = "", None, None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return usage.completion_tokens, reason, text


async def leaving_stream(client: openai.AsyncOpenAI, prompt: str) -> int:
    """Reads two chunks, then closes the connection; returns the chunks read."""
    chunks = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=LEAVING_TOKENS, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    read = 0
    async for _ in chunks:
        read += 1
        if read == 2:
            break
    await chunks.close()
    return read


async def run_streams(server: str) -> tuple[list, list]:
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    prompts = [f"{WORDS[i % len(WORDS)]} {WORDS[(7 * i) % len(WORDS)]}" for i in range(NUM_STREAMS)]
    leaving = [leaving_stream(client, p) for p in prompts[:NUM_LEAVING]]
    full = [full_stream(client, p) for p in prompts[NUM_LEAVING:]]
    results = await asyncio.wait_for(asyncio.gather(*leaving, *full), timeout=60)
    await client.close()
    return results[:NUM_LEAVING], results[NUM_LEAVING:]


def test_concurrent_streams_with_early_disconnects(server):
    aborted_before = scrape_metrics(server)[ABORTED]
    leaving, full = asyncio.run(run_streams(server))
    assert leaving == [2] * NUM_LEAVING
    assert [(tokens, reason) for tokens, reason, _ in full] == [(FULL_TOKENS, "length")] * len(full)
    assert all(text for _, _, text in full)
    metrics = wait_until_idle(server)
    assert metrics[ABORTED] - aborted_before == NUM_LEAVING


def test_non_streaming_client_disconnect_aborts(server):
    aborted_before = scrape_metrics(server)[ABORTED]
    body = {"prompt": "the old man", "max_tokens": 250, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    metrics = wait_until_idle(server)
    assert metrics[ABORTED] - aborted_before == 1
