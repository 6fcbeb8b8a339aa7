"""What each engine step adds to a streaming call's choices, as deltas.

The engine's outputs are cumulative (each carries a choice's whole text and tokens so
far). A streaming call only needs what is new, so the engine thread turns each output into
a delta at once: what waits for a slow client grows with what it has not read, never with
the square of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.engine.outputs import CompletionOutput, Logprobs, RequestOutput
from atom.sampling_params import SamplingParams

# Tokens kept before each delta's first, so the text a token adds can be decoded in context
# (a SentencePiece leading space, a multi-byte character split over several tokens).
CONTEXT_TOKENS = 6


@dataclass
class ChoiceDelta:
    index: int  # the completion's index among its prompt's n
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    first_token: int  # the index of token_ids[0] in the whole completion
    context_ids: list[int]  # the up to CONTEXT_TOKENS tokens before token_ids[0]

    @property
    def is_first(self) -> bool:
        return self.first_token == 0


@dataclass
class OutputDelta:
    """One engine request's (one prompt's) deltas, one per choice that has any."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[ChoiceDelta]
    finished: bool
    num_output_tokens: int  # over all its choices so far (for usage)

    @property
    def num_tokens(self) -> int:
        """The tokens this delta carries, over its choices."""
        return sum(len(choice.token_ids) for choice in self.choices)


class DeltaTracker:
    """What one engine request's choices have handed on so far.

    With stop strings, the last len(longest stop) - 1 characters are held back while a
    choice runs: they may be the start of a stop string, which the final text drops.
    """

    def __init__(self, params: SamplingParams):
        self.holdback = max((len(stop) for stop in params.stop), default=1) - 1
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def advance(self, output: RequestOutput) -> OutputDelta | None:
        """The delta since the last call, or None when there is nothing worth a chunk."""
        choices = [d for c in output.outputs if (d := self._choice(c)) is not None]
        if not choices and not output.finished:
            return None
        return OutputDelta(
            output.request_id,
            output.prompt_token_ids,
            choices,
            output.finished,
            sum(len(c.token_ids) for c in output.outputs),
        )

    def _choice(self, completion: CompletionOutput) -> ChoiceDelta | None:
        index = completion.index
        if index in self.done:
            return None
        sent_chars = self.sent_chars.get(index, 0)
        sent_tokens = self.sent_tokens.get(index, 0)
        finished = completion.finish_reason is not None
        end = len(completion.text) if finished else len(completion.text) - self.holdback
        text = completion.text[sent_chars : max(end, sent_chars)]
        # The engine appends to its logprobs list in place, so cut it at the tokens seen here.
        num_tokens = len(completion.token_ids)
        logprobs = completion.logprobs
        if logprobs is not None:
            logprobs = logprobs[sent_tokens:num_tokens]
        if not (text or finished or logprobs):
            return None
        self.sent_chars[index] = sent_chars + len(text)
        self.sent_tokens[index] = num_tokens
        if finished:
            self.done.add(index)
        return ChoiceDelta(
            index,
            text,
            completion.token_ids[sent_tokens:num_tokens],
            logprobs,
            completion.finish_reason,
            completion.stop_reason,
            first_token=sent_tokens,
            context_ids=completion.token_ids[max(0, sent_tokens - CONTEXT_TOKENS) : sent_tokens],
        )
