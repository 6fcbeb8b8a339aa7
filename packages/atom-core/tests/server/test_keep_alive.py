"""Responses over a kept-alive connection are not held back by Nagle's algorithm: every
accepted connection has TCP_NODELAY, so a client that delays its ACKs (as Linux does on an
established connection) waits no ~40 ms per response."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

import openai

from atom.server.launcher import bind
from tests.server.server_process import MODEL

SAMPLES = 15
# Nagle against a delayed ACK costs at least 40 ms (Linux's shortest delayed-ACK timeout);
# half of it leaves room for a loaded machine without letting that stall through.
MOST_EXTRA_MS = 20


def test_accepted_connections_have_tcp_nodelay():
    """The listening socket run_server makes, served by asyncio as uvicorn serves it."""
    listener = bind("127.0.0.1", 0)

    async def nodelay_of_an_accepted_connection() -> int:
        accepted = asyncio.get_running_loop().create_future()

        class Recorder(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Recorder, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0


def test_kept_alive_connection_is_as_quick_as_a_fresh_one(server, client):
    """A fresh connection stands in for a quick-ACK client (Linux ACKs at once while a
    connection is new). The kept-alive requests follow one another at once: after a pause
    Linux ACKs quickly again, which would hide the stall."""

    def one_token_ms(openai_client: openai.OpenAI) -> float:
        start = time.perf_counter()
        openai_client.completions.create(model=MODEL, prompt="a", max_tokens=1)
        return (time.perf_counter() - start) * 1e3

    one_token_ms(client)  # opens the connection the client then keeps alive
    kept_alive = [one_token_ms(client) for _ in range(SAMPLES)]
    fresh = []
    for _ in range(SAMPLES):
        with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as new:
            fresh.append(one_token_ms(new))
    kept_ms, fresh_ms = statistics.median(kept_alive), statistics.median(fresh)
    assert kept_ms < fresh_ms + MOST_EXTRA_MS, (
        f"a 1-token completion takes {kept_ms:.1f} ms (median) over a kept-alive connection, "
        f"{fresh_ms:.1f} ms over a fresh one"
    )
