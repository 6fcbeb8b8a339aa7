"""The server through the official `openai` client: completions, chat, streaming, n > 1,
stop strings and logprobs, checked against the offline `atom.LLM` on the same model."""

from __future__ import annotations

import httpx

from atom import SamplingParams
from tests.server.server_process import MODEL

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "a river runs past green hills"}]
IGNORE_EOS = {"ignore_eos": True}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def stream_texts(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and the finish reason per choice index, and the usage chunk's usage."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text = choice.text if hasattr(choice, "text") else choice.delta.content or ""
            texts[choice.index] = texts.get(choice.index, "") + text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_models_and_health(client, server):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 256
    assert httpx.get(f"{server}/health").status_code == 200


def test_text_and_token_prompts_equal_offline_greedy(client, offline):
    token_prompt = offline.tokenizer.encode("a river runs past")
    expected = offline.generate([PROMPT, token_prompt], greedy(12), use_tqdm=False)
    for prompt, want in zip([PROMPT, token_prompt], expected):
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
        )
        (choice,) = response.choices
        assert choice.text == want.outputs[0].text
        assert choice.finish_reason == "length"
        assert response.usage.prompt_tokens == len(want.prompt_token_ids)
        assert response.usage.completion_tokens == 12


def test_batch_of_prompts_and_n(client):
    response = client.completions.create(
        model=MODEL, prompt=[PROMPT, "a small cat"], n=3, max_tokens=8, seed=5,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert [c.index for c in response.choices] == list(range(6))
    assert response.usage.completion_tokens == 6 * 8
    first_prompt = {c.text for c in response.choices[:3]}
    assert len(first_prompt) > 1  # the n samples of one prompt differ


def test_chat_equals_offline_chat(client, offline):
    expected = offline.chat(MESSAGES, greedy(10), use_tqdm=False)[0]
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=IGNORE_EOS
    )
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_deltas_equal_the_whole_text(client):
    kwargs = {"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": 16, "seed": 3}
    whole = client.completions.create(**kwargs, extra_body=IGNORE_EOS)
    chunks = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS
    )
    texts, reasons, usage = stream_texts(chunks)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == whole.usage.completion_tokens == 32


def test_chat_stream_equals_chat(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "seed": 1}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons, _ = stream_texts(chunks)
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}


def test_stop_string_truncates_output(client):
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "seed": 7}
    full = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
    stop = " " + full.split()[6]
    expected = full[: full.index(stop)]
    stopped = client.completions.create(**kwargs, stop=[stop], extra_body=IGNORE_EOS)
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    chunks = client.completions.create(**kwargs, stop=[stop], stream=True, extra_body=IGNORE_EOS)
    assert stream_texts(chunks)[:2] == ({0: expected}, {0: "stop"})


def test_stop_token_ids(client, offline):
    tokens = offline.generate([PROMPT], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens.index(tokens[5]) + 1
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={**IGNORE_EOS, "stop_token_ids": [tokens[5]]},
    )  # fmt: skip
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == stop_at
    # As in vLLM, the text leaves out the stop token.
    tokenizer = offline.tokenizer
    assert response.choices[0].text == tokenizer.decode(tokens[: stop_at - 1])
    assert response.choices[0].text != tokenizer.decode(tokens[:stop_at])


def test_completion_logprobs(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body=IGNORE_EOS
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) >= 3 and top[token] == logprob
        assert logprob == max(top.values()) <= 0  # greedy picks the most likely token


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, seed=0
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2 and entry.logprob <= entry.top_logprobs[0].logprob
        assert entry.bytes == list(entry.token.encode())
