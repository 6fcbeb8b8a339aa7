"""Engine logprobs (token id -> logprob, per position) in the two OpenAI response shapes."""

from __future__ import annotations

from itertools import accumulate

from atom.engine.outputs import Logprobs
from atom.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer, token_ids: list[int], entries: Logprobs, text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy shape; each position's top dict holds the sampled token and the top-k."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[entry[t] for t, entry in zip(token_ids, entries)],
        top_logprobs=[
            {token_text(tokenizer, t): logprob for t, logprob in entry.items()} for entry in entries
        ],
        text_offset=list(accumulate((len(t) for t in tokens[:-1]), initial=text_offset)),
    )


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
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
