"""Request outputs shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

# One dict per position: token id -> its logprob (the sampled token and the top-k).
Logprobs = list[dict[int, float]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Logprobs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    """When a request reached each stage, in `time.monotonic()` seconds (None: not yet).

    The request's own record, updated as it advances: first_scheduled_time when the
    scheduler first ran one of its sequences, the token times when a sampled token of any
    of them reached the host.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def token_ids(self) -> list[int]:
        """The first completion's tokens (the common n=1 case)."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text
