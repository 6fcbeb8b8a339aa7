"""GET /metrics: Prometheus text that prometheus_client parses, every series labelled with
the served model name and listed in docs/serving.md; latency histograms that count each
request once, gauges back at zero when idle, and prefix-cache hits for a repeated prompt."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from atom.demo import WORDS
from atom.server import AsyncEngine, build_app
from tests.server.server_process import MODEL, parse_metrics, wait_until_idle

SERVING_DOC = Path(__file__).resolve().parents[4] / "docs" / "serving.md"
REQUEST_HISTOGRAMS = (
    "atom:request_queue_time_seconds",
    "atom:time_to_first_token_seconds",
    "atom:e2e_request_latency_seconds",
)
INTER_TOKEN = "atom:inter_token_latency_seconds"
IGNORE_EOS = {"ignore_eos": True}
BLOCK_SIZE = 16  # the test server's (conftest.ENGINE_KWARGS)


def test_every_series_is_documented(server):
    response = httpx.get(f"{server}/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    exported = {
        # The text format names a counter's sample `<family>_total`, as the docs do.
        family.name + ("_total" if family.type == "counter" else ""): (
            family.type,
            {label for sample in family.samples for label in sample.labels} - {"le"},
        )
        for family in text_string_to_metric_families(response.text)
        if not family.name.endswith("_created")  # prometheus_client's start times
    }
    rows = re.findall(r"^\| `(atom:\w+)` \| (\w+) \| ([^|]+) \|", SERVING_DOC.read_text(), re.M)
    documented = {
        name: (kind, set(re.findall(r"`(\w+)`", labels)) - {"le"}) for name, kind, labels in rows
    }
    # A family with no samples yet shows no labels (per-position spec-decode counts
    # without speculative decoding).
    for name, (kind, labels) in exported.items():
        if not labels and name in documented:
            exported[name] = (kind, documented[name][1])
    assert exported == documented


def test_histograms_count_each_request_and_gauges_return_to_idle(server, client):
    before = wait_until_idle(server)
    usages = [
        client.completions.create(
            model=MODEL, prompt="the quick brown fox", max_tokens=5, extra_body=IGNORE_EOS
        ).usage,
        stream_usage(
            client.completions.create(
                model=MODEL, prompt="a small cat", max_tokens=7, stream=True,
                stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
            )
        ),
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a river"}], max_tokens=4,
            extra_body=IGNORE_EOS,
        ).usage,
        stream_usage(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "green hills"}], max_tokens=6,
                stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
            )
        ),
    ]  # fmt: skip
    batch = client.completions.create(
        model=MODEL, prompt=["the old man", "his paper"], max_tokens=3, extra_body=IGNORE_EOS
    )
    num_requests = len(usages) + 2  # the batch is one engine request per prompt
    generated = sum(u.completion_tokens for u in usages) + batch.usage.completion_tokens
    prompt_tokens = sum(u.prompt_tokens for u in usages) + batch.usage.prompt_tokens
    after = wait_until_idle(server)

    def added(sample: str) -> float:
        return after[sample] - before[sample]

    assert added("atom:requests_total") == num_requests
    assert added('atom:request_success_total{finished_reason="length"}') == num_requests
    assert added("atom:prompt_tokens_total") == prompt_tokens
    assert added("atom:generation_tokens_total") == generated
    for name in REQUEST_HISTOGRAMS:
        assert added(f"{name}_count") == num_requests, name
    # One interval per token after each request's first.
    assert added(f"{INTER_TOKEN}_count") == generated - num_requests
    # The stages come in order: scheduled, first token, last token.
    queue, first_token, e2e = (added(f"{name}_sum") for name in REQUEST_HISTOGRAMS)
    assert 0 < queue <= first_token <= e2e
    for name in (*REQUEST_HISTOGRAMS, INTER_TOKEN):
        buckets = [v for k, v in after.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"{name}_count"], name
    assert after["atom:num_requests_running"] == after["atom:num_requests_waiting"] == 0
    assert after["atom:kv_cache_usage_perc"] == 0
    assert after["atom:kv_cache_free_blocks"] == after["atom:kv_cache_blocks"]


def test_a_repeated_prompt_hits_the_prefix_cache(server, client):
    # 100 words in an order no other test uses, so the first request finds nothing cached.
    prompt = " ".join(WORDS[(5 * i + 3) % len(WORDS)] for i in range(100))
    before = wait_until_idle(server)
    num_tokens = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
        for _ in range(2)
    ][0]
    after = wait_until_idle(server)
    hits = after["atom:prefix_cache_hits_total"] - before["atom:prefix_cache_hits_total"]
    queries = after["atom:prefix_cache_queries_total"] - before["atom:prefix_cache_queries_total"]
    assert queries == 2 * num_tokens
    # The second finds every full block but the one with the last token, which it recomputes.
    assert hits == (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_each_app_has_a_registry_of_its_own(offline):
    engine = AsyncEngine(offline.engine)
    try:
        for name in ("first", "second"):  # a second app in the process does not collide
            text = TestClient(build_app(engine, name)).get("/metrics").text
            assert parse_metrics(text, model=name)["atom:requests_total"] == 0
    finally:
        engine.shutdown()
    assert b"atom:" not in generate_latest(REGISTRY)


def stream_usage(chunks):
    """Reads a stream to its end; the usage of its last chunk."""
    return [chunk.usage for chunk in chunks][-1]
