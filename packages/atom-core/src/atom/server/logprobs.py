"""Engine logprobs (token id -> logprob, per position) in the two OpenAI response shapes.

Token strings follow vLLM's convention: each is the text that token adds to the output,
so the tokens of a choice join into its text and `text_offset` indexes each exactly. A
token is decoded after the few tokens before it, not alone: a word-piece or SentencePiece
token's spacing depends on its neighbour, and a byte of a multi-byte character adds
nothing until the token that completes the character.
"""

from __future__ import annotations

from atom.engine.outputs import Logprobs
from atom.server.deltas import CONTEXT_TOKENS
from atom.server.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf, which a token masked off (guided decoding, a logit_bias of -100 on a
# tiny vocabulary) would have: such logprobs are written as this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _decoded(tokenizer, ids: list[int], final: bool = False) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    # A trailing U+FFFD is a multi-byte character still incomplete: it adds nothing yet,
    # unless the output ends there (its text then ends in U+FFFD too).
    return text if final else text.rstrip("\ufffd")


def _added(tokenizer, before: str, context: list[int], token_id: int, final: bool) -> str:
    """The text `token_id` adds after `context` (which decodes to `before`); `final`: the
    output ends with it."""
    after = _decoded(tokenizer, [*context, token_id], final)
    if after.startswith(before):
        return after[len(before) :]
    common = 0  # decoding changed the context's text (a cleanup rule): keep what is new
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    return after[common:]


def token_strings(
    tokenizer, context_ids: list[int], token_ids: list[int], entries: Logprobs, ends: bool
) -> tuple[list[str], list[dict[int, str]]]:
    """For each of token_ids (which follow context_ids): the text it adds, and the text each
    token of its logprob entry would have added in its place. ends: the output ends with
    token_ids."""
    if tokenizer is None:
        names = [f"token_id:{t}" for t in token_ids]
        return names, [{t: f"token_id:{t}" for t in entry} for entry in entries]
    ids = [*context_ids, *token_ids]
    first = len(context_ids)
    tokens, alternatives = [], []
    for i, entry in zip(range(first, len(ids)), entries):
        context = ids[max(0, i - CONTEXT_TOKENS) : i]
        before = _decoded(tokenizer, context)
        final = ends and i == len(ids) - 1
        tokens.append(_added(tokenizer, before, context, ids[i], final))
        alternatives.append({t: _added(tokenizer, before, context, t, final) for t in entry})
    return tokens, alternatives


def completion_logprobs(
    tokenizer,
    context_ids: list[int],
    token_ids: list[int],
    entries: Logprobs,
    text_offset: int,
    ends: bool,
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for token_ids (which follow context_ids in the completion), whose
    text begins at `text_offset` of the completion; also returns where the next token's
    begins. Each position's top dict holds the sampled token and the top-k. ends: the
    completion ends with token_ids."""
    tokens, alternatives = token_strings(tokenizer, context_ids, token_ids, entries, ends)
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    logprobs = CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_finite(entry[t]) for t, entry in zip(token_ids, entries)],
        top_logprobs=[
            {names[t]: _finite(logprob) for t, logprob in entry.items()}
            for names, entry in zip(alternatives, entries)
        ],
        text_offset=offsets,
    )
    return logprobs, text_offset


def chat_logprobs(
    tokenizer,
    context_ids: list[int],
    token_ids: list[int],
    entries: Logprobs,
    num_top: int,
    ends: bool,
) -> ChatLogprobs:
    """The chat shape for token_ids (which follow context_ids); `top_logprobs` lists
    exactly the `num_top` most likely tokens. ends: the output ends with token_ids."""
    tokens, alternatives = token_strings(tokenizer, context_ids, token_ids, entries, ends)
    content = []
    for token, token_id, names, entry in zip(tokens, token_ids, alternatives, entries):
        best = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:num_top]
        content.append(
            TokenLogprob(
                **_top_logprob(token, entry[token_id]).model_dump(),
                top_logprobs=[_top_logprob(names[t], logprob) for t, logprob in best],
            )
        )
    return ChatLogprobs(content=content)


def _top_logprob(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))
