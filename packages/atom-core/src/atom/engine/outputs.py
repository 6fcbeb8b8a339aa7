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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None
    finished: bool = True
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        """The first completion's tokens (the common n=1 case)."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text
