"""AsyncEngine without a model: engine errors reach the caller and the loop survives them."""

from __future__ import annotations

import asyncio

import pytest

from atom.engine.llm_engine import EngineStats
from atom.sampling_params import SamplingParams
from atom.server.async_engine import AsyncEngine
from atom.server.metrics import ServingMetrics


class FailingEngine:
    """Refuses empty prompts like LLMEngine, accepts others, and fails every step."""

    tokenizer = None

    def __init__(self):
        self.requests: dict[str, str] = {}

    def add_request(
        self, prompt: str, params: SamplingParams, request_id: str, arrival_time: float | None
    ) -> str:
        if not prompt:
            raise ValueError("prompt is empty")
        self.requests[request_id] = prompt
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        raise RuntimeError("the model broke")

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 1, 1, 0.0, 0, 0, 0)


def engine_with_metrics(fake: FailingEngine) -> tuple[AsyncEngine, ServingMetrics]:
    engine = AsyncEngine(fake)
    metrics = ServingMetrics("fake", engine.stats)
    engine.add_metrics(metrics)
    return engine, metrics


def sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "fake", **labels})


async def drain(stream) -> None:
    async for _ in stream:
        pass


def test_bad_prompt_in_a_batch_adds_nothing():
    async def scenario(engine: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
            await engine.submit(["fine", ""], SamplingParams())

    fake = FailingEngine()
    engine, metrics = engine_with_metrics(fake)
    try:
        asyncio.run(scenario(engine))
        assert fake.requests == {} and sample(metrics, "atom:requests_total") == 0
    finally:
        engine.shutdown()


def test_step_failure_fails_requests_and_the_loop_goes_on():
    async def scenario(engine: AsyncEngine) -> None:
        for _ in range(2):  # the second request meets a loop that survived the first failure
            stream = await engine.submit(["a", "b"], SamplingParams())
            with pytest.raises(RuntimeError, match="the model broke"):
                await asyncio.wait_for(drain(stream), timeout=10)
            assert stream.finished

    fake = FailingEngine()
    engine, metrics = engine_with_metrics(fake)
    try:
        asyncio.run(scenario(engine))
        assert engine.is_alive and fake.requests == {}
        assert sample(metrics, "atom:request_success_total", finished_reason="abort") == 4
    finally:
        engine.shutdown()
