"""A request with the worst stop strings the limits allow (64 of them, 16,384 characters in
all, built from the very text it generates so matches run deep) does not stall other
clients: their latency stays within a few times what it is alone. Before stop strings were
matched incrementally one such request took another client's 8-token completion from
39 ms to 2.9 s (p50)."""

from __future__ import annotations

import statistics
import threading
import time

import openai

from tests.server.conftest import MAX_N
from tests.server.server_process import MODEL

SAMPLES = 15
HEAVY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200, "temperature": 0,
         "extra_body": {"ignore_eos": True}}  # fmt: skip
# The heavy request's choices share each step with the other client's one sequence, so
# its steps do grow: by a few times at most, not the 75 times of a stalled engine.
MOST_SLOWDOWN = 5
SLACK_MS = 50  # for timer noise on a loaded 2-core machine


def worst_stop_strings(text: str) -> list[str]:
    """64 stop strings of 256 characters: pieces of `text` after a character it never
    holds, so none completes but each walks the matcher far back along the text."""
    pieces = [(text * 2)[i : i + 255] for i in range(0, 64 * 7, 7)]
    return ["\u2603" + piece for piece in pieces]


def eight_tokens_ms(client: openai.OpenAI) -> float:
    start = time.perf_counter()
    client.completions.create(
        model=MODEL, prompt="a", max_tokens=8, extra_body={"ignore_eos": True}
    )
    return (time.perf_counter() - start) * 1e3


def test_worst_stop_strings_do_not_stall_other_clients(server, client):
    text = client.completions.create(**HEAVY).choices[0].text
    stops = worst_stop_strings(text)
    assert len(stops) == 64 and sum(map(len, stops)) == 16384
    alone = statistics.median(eight_tokens_ms(client) for _ in range(SAMPLES))

    heavy_client = openai.OpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0, timeout=120)
    done = threading.Event()

    def heavy() -> None:
        while not done.is_set():
            heavy_client.completions.create(**HEAVY, n=MAX_N, stop=stops)

    runner = threading.Thread(target=heavy)
    runner.start()
    try:
        time.sleep(0.5)  # the heavy request is decoding
        beside = statistics.median(eight_tokens_ms(client) for _ in range(SAMPLES))
    finally:
        done.set()
        runner.join()
    assert beside < alone * MOST_SLOWDOWN + SLACK_MS, (
        f"an 8-token completion takes {beside:.0f} ms (median) beside the stop-string "
        f"request, {alone:.0f} ms alone"
    )
