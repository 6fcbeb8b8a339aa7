"""Sampling parameters, shaped like vLLM's, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from atom.stop_strings import StopStrings

if TYPE_CHECKING:
    import torch


class SamplingParamsError(ValueError):
    pass


class TokenGuide(Protocol):
    """Restricts one completion's tokens (guided decoding): the engine asks it which tokens
    may come next before each sample, then tells it the token that was sampled."""

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        """A bool CPU tensor [vocab_size]: True where a token may come next."""

    def accept(self, token_id: int) -> None: ...

    @property
    def is_done(self) -> bool:
        """True once nothing may follow: the completion ends there."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Builds the TokenGuide of each completion (each has its own state).
    guide_factory: Callable[[], TokenGuide] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be >= 0, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative integers",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingParamsError(message)
        self._validate_logit_bias()
        if self.guide_factory is not None and not callable(self.guide_factory):
            raise SamplingParamsError("guide_factory must be callable")

    def _validate_logit_bias(self) -> None:
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise SamplingParamsError(
                    f"logit_bias keys must be non-negative token ids, got {token!r}"
                )
            if not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise SamplingParamsError(
                    f"logit_bias values must be finite numbers, got {bias!r} for token {token}"
                )

    @cached_property
    def stop_strings(self) -> StopStrings:
        """`stop` made ready to match, once per request (its completions share it)."""
        return StopStrings(self.stop)

    @property
    def has_logits_processors(self) -> bool:
        """Whether the sampler must change this request's logits beyond its filters."""
        return bool(self.logit_bias) or self.guide_factory is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
