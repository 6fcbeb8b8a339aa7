"""Engine logprobs (token id -> logprob, per position) in the two OpenAI response shapes."""

from __future__ import annotations

from atom.engine.outputs import Logprobs
from atom.server.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# Tokens of context decoded before each token when measuring the text it adds: enough for
# a SentencePiece leading space or a multi-byte character split over several tokens.
CONTEXT_TOKENS = 6
# JSON has no -inf, which a token masked off (guided decoding, a logit_bias of -100 on a
# tiny vocabulary) would have: such logprobs are written as this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def text_added(tokenizer, token_ids: list[int], start: int, end: int) -> list[int]:
    """How many characters of the decoded text each of token_ids[start:end] adds.

    Decoding one token alone is not enough: a word-piece or SentencePiece token's spacing
    depends on its neighbour, and a byte of a multi-byte character decodes to nothing
    until the character is complete.
    """
    if tokenizer is None:
        return [0] * (end - start)

    def length(ids: list[int]) -> int:
        return len(tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd"))

    added = []
    for i in range(start, end):
        context = token_ids[max(0, i - CONTEXT_TOKENS) : i]
        added.append(length([*context, token_ids[i]]) - length(context))
    return added


def completion_logprobs(
    tokenizer, token_ids: list[int], start: int, entries: Logprobs, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for tokens token_ids[start : start + len(entries)], whose text
    begins at `text_offset` of the completion; also returns where the next token's begins.
    Each position's top dict holds the sampled token and the top-k."""
    ids = token_ids[start : start + len(entries)]
    offsets = []
    for added in text_added(tokenizer, token_ids, start, start + len(ids)):
        offsets.append(text_offset)
        text_offset += added
    logprobs = CompletionLogprobs(
        tokens=[token_text(tokenizer, t) for t in ids],
        token_logprobs=[_finite(entry[t]) for t, entry in zip(ids, entries)],
        top_logprobs=[
            {token_text(tokenizer, t): _finite(logprob) for t, logprob in entry.items()}
            for entry in entries
        ],
        text_offset=offsets,
    )
    return logprobs, text_offset


def chat_logprobs(tokenizer, token_ids: list[int], entries: Logprobs, num_top: int) -> ChatLogprobs:
    """The chat shape; `top_logprobs` lists exactly the `num_top` most likely tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        best = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:num_top]
        content.append(
            TokenLogprob(
                **_top_logprob(tokenizer, token_id, entry[token_id]).model_dump(),
                top_logprobs=[_top_logprob(tokenizer, t, logprob) for t, logprob in best],
            )
        )
    return ChatLogprobs(content=content)


def _top_logprob(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))
