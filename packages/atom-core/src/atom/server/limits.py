"""Bounds a request must meet before it costs the server anything: choices, stop strings
and prompt size.

A text prompt is refused on its character count alone, before tokenizing, when it cannot
fit the context: no token stands for more characters than the longest vocabulary entry,
so `max_model_len * longest` characters make at least `max_model_len` tokens. (This holds
for byte-level BPE and SentencePiece; a normalizer that drops characters would break it.)
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.sampling_params import SamplingParams
from atom.server.errors import APIError
from atom.server.options import ServeOptions
from atom.server.protocol import SamplingRequest


@dataclass(frozen=True)
class RequestLimits:
    max_n: int
    max_model_len: int
    max_prompt_chars: int | None  # None: no tokenizer, so no text prompts at all
    max_stop_strings: int
    max_stop_chars: int

    @classmethod
    def of(cls, tokenizer, max_model_len: int, options: ServeOptions):
        stop = (options.max_stop_strings, options.max_stop_chars)
        if tokenizer is None:
            return cls(options.max_n, max_model_len, None, *stop)
        longest_token = max(map(len, tokenizer.get_vocab()))
        return cls(options.max_n, max_model_len, max_model_len * longest_token, *stop)

    def check_choices(self, request: SamplingRequest, num_prompts: int) -> None:
        """n and best_of, and prompts x n, within --max-n."""
        for field in ("n", "best_of"):
            value = getattr(request, field, None)
            if value is not None and value > self.max_n:
                raise APIError(
                    400, f"{field} must be <= {self.max_n} (--max-n), got {value}", param=field
                )
        best_of = getattr(request, "best_of", None)
        if best_of is not None and best_of != (request.n or 1):
            raise APIError(
                400, "best_of other than n is not supported (nor in vLLM V1)", param="best_of"
            )
        choices = (request.n or 1) * num_prompts
        if choices > self.max_n:
            raise APIError(
                400,
                f"{num_prompts} prompts x n={request.n or 1} make {choices} choices; "
                f"the limit is {self.max_n} per request (--max-n)",
                param="prompt",
            )

    def check_stop(self, params: SamplingParams) -> None:
        """At most --max-stop-strings stop strings of --max-stop-chars characters in all."""
        if len(params.stop) > self.max_stop_strings:
            raise APIError(
                400,
                f"stop has {len(params.stop)} strings; the limit is {self.max_stop_strings} "
                "(--max-stop-strings)",
                param="stop",
            )
        chars = sum(map(len, params.stop))
        if chars > self.max_stop_chars:
            raise APIError(
                400,
                f"stop has {chars} characters in all; the limit is {self.max_stop_chars} "
                "(--max-stop-chars)",
                param="stop",
            )

    def check_max_tokens(self, request: SamplingRequest, params: SamplingParams) -> None:
        """max_tokens beyond max_model_len is a 400, as in vLLM (up to it, the output stops
        where the context ends)."""
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            param = "max_tokens"
            if getattr(request, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"
            raise APIError(
                400,
                f"{param}={params.max_tokens} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens.",
                param=param,
            )

    def check_prompt(self, prompt: str | list[int], param: str) -> None:
        """Refuses a prompt that cannot fit max_model_len, without tokenizing it."""
        if isinstance(prompt, list):
            if len(prompt) >= self.max_model_len:
                raise APIError(
                    400,
                    f"{param} has {len(prompt)} tokens; max_model_len is {self.max_model_len}",
                    param=param,
                )
        elif self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param} has {len(prompt)} characters, more than {self.max_prompt_chars} "
                f"can fit in max_model_len={self.max_model_len} tokens",
                param=param,
            )
