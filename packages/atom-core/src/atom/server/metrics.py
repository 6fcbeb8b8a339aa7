"""Prometheus metrics of one served model, named as vLLM's (`atom:` for `vllm:`) where
vLLM has the series.

Every series carries `model_name` (the served model name). Latencies come from each
request's RequestMetrics, stamped by the engine: arrival (the route handler took the
request, before tokenizing), first scheduled, and each sampled token's arrival on the host.
Counts are per engine request, that is per prompt; a request with n > 1 has one
inter-token interval per completion and token after the completion's first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from atom.engine.llm_engine import EngineStats
from atom.engine.outputs import RequestOutput

FINISH_REASONS = ("stop", "length", "abort")
# Seconds. Queueing and first tokens range from a millisecond on an idle GPU to minutes
# behind a long queue; decode steps from a few milliseconds to a stalled second or more.
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
    40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass
class _Progress:
    """What has been recorded of one live request, per completion."""

    num_tokens: list[int]
    last_token_time: list[float | None]


class ServingMetrics:
    """The metrics of one app, in a registry of its own (not prometheus_client's global
    one, so several apps can live in one process).

    The AsyncEngine feeds it from the engine thread (`added`, `output`, `aborted`);
    `render` runs on the event loop. prometheus_client's metrics are thread-safe.
    """

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        self._progress: dict[str, _Progress] = {}

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, ["model_name"], registry=self.registry).labels(
                model_name
            )

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                name, documentation, ["model_name"], registry=self.registry, buckets=buckets
            ).labels(model_name)

        self._requests = counter("atom:requests", "Engine requests admitted (one per prompt).")
        finished = Counter(
            "atom:request_success",
            "Engine requests ended, by finish reason (abort: the client left or failed).",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Made up front, so every reason is exported from the start.
        self._finished = {reason: finished.labels(model_name, reason) for reason in FINISH_REASONS}
        self._prompt_tokens = counter("atom:prompt_tokens", "Prompt tokens of requests run.")
        self._generation_tokens = counter("atom:generation_tokens", "Tokens generated.")
        self._queue_time = histogram(
            "atom:request_queue_time_seconds",
            "From a request's arrival until the scheduler first runs it.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._time_to_first_token = histogram(
            "atom:time_to_first_token_seconds",
            "From a request's arrival until its first token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._inter_token_latency = histogram(
            "atom:inter_token_latency_seconds",
            "Between consecutive tokens of one completion.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._e2e_latency = histogram(
            "atom:e2e_request_latency_seconds",
            "From a request's arrival until its last token (requests that stopped or hit "
            "their length; not aborted ones).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.registry.register(_EngineStatsCollector(model_name, engine_stats))

    def render(self) -> bytes:
        """The Prometheus text exposition format, version 0.0.4."""
        return generate_latest(self.registry)

    def added(self, request_ids: list[str]) -> None:
        self._requests.inc(len(request_ids))

    def aborted(self, request_ids: list[str]) -> None:
        """Requests that ended without finishing (only live ones may be passed)."""
        for request_id in request_ids:
            self._progress.pop(request_id, None)
        self._finished["abort"].inc(len(request_ids))

    def output(self, output: RequestOutput) -> None:
        """Records an engine output: one per step that ran the request."""
        metrics = output.metrics
        progress = self._progress.get(output.request_id)
        if progress is None:  # the step that first scheduled it
            progress = _Progress([0] * len(output.outputs), [None] * len(output.outputs))
            self._progress[output.request_id] = progress
            self._prompt_tokens.inc(len(output.prompt_token_ids))
            self._queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        had_tokens = any(progress.num_tokens)
        for completion in output.outputs:
            index, num_tokens = completion.index, len(completion.token_ids)
            new_tokens = num_tokens - progress.num_tokens[index]
            if new_tokens == 0:
                continue
            # Every token of a step reaches the host at once: last_token_time is this
            # step's, shared by the completions that gained tokens in it.
            previous = progress.last_token_time[index]
            if previous is not None:
                self._inter_token_latency.observe(metrics.last_token_time - previous)
            progress.num_tokens[index] = num_tokens
            progress.last_token_time[index] = metrics.last_token_time
            self._generation_tokens.inc(new_tokens)
        if not had_tokens and metrics.first_token_time is not None:
            self._time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
        if output.finished:
            del self._progress[output.request_id]
            self._finished[output.outputs[0].finish_reason].inc()
            self._e2e_latency.observe(metrics.last_token_time - metrics.arrival_time)


class _EngineStatsCollector(Collector):
    """The engine's own figures, read at each scrape from its latest stats."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats]):
        self._model_name = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._engine_stats()
        families = [
            (GaugeMetricFamily, "atom:num_requests_running",
             "Sequences in the running batch (a request with n > 1 counts n).",
             stats.num_running),
            (GaugeMetricFamily, "atom:num_requests_waiting", "Sequences waiting to be scheduled.",
             stats.num_waiting),
            (GaugeMetricFamily, "atom:kv_cache_usage_perc",
             "Fraction of KV cache blocks in use (0 to 1).", stats.kv_cache_usage),
            (GaugeMetricFamily, "atom:kv_cache_free_blocks", "KV cache blocks free.",
             stats.num_free_blocks),
            (GaugeMetricFamily, "atom:kv_cache_blocks", "KV cache blocks in all.",
             stats.num_blocks),
            (CounterMetricFamily, "atom:prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            (CounterMetricFamily, "atom:prefix_cache_hits",
             "Prompt tokens served by the prefix cache.", stats.prefix_cache_hits),
            (CounterMetricFamily, "atom:num_preemptions",
             "Sequences preempted to free KV blocks.", stats.num_preemptions),
        ]  # fmt: skip
        spec = stats.spec_decode
        families += [
            (CounterMetricFamily, "atom:spec_decode_num_drafts",
             "Verify steps of a sequence with drafted tokens.", spec.num_drafts),
            (CounterMetricFamily, "atom:spec_decode_num_draft_tokens",
             "Drafted tokens verified.", spec.num_draft_tokens),
            (CounterMetricFamily, "atom:spec_decode_num_accepted_tokens",
             "Drafted tokens accepted.", spec.num_accepted_tokens),
        ]  # fmt: skip
        for family, name, documentation, value in families:
            metric = family(name, documentation, labels=["model_name"])
            metric.add_metric([self._model_name], value)
            yield metric
        per_position = CounterMetricFamily(
            "atom:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each draft position.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([self._model_name, str(position)], count)
        yield per_position
