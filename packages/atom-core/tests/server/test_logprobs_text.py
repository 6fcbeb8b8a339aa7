"""Logprob token strings follow vLLM's convention: each is the text that token adds, so a
choice's tokens join into its text and `text_offset` indexes each token exactly, spaces
and multi-byte characters (whole, split over tokens, or broken) included."""

from __future__ import annotations

import httpx
import pytest

from atom.server.logprobs import token_strings
from tests.server.byte_level_model import build_tokenizer, write_byte_level_model
from tests.server.server_process import MODEL, running_server

# The bytes of "é" (two tokens of the byte-level vocabulary) and a space, favoured so
# sampling writes spaces and two-byte characters, whole and broken, whatever the weights.
FAVOURED_TEXT = ["é", " "]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    folder = write_byte_level_model(tmp_path_factory.mktemp("byte-level"))
    options = {"dtype": "float32", "block_size": 16, "num_blocks": 256}
    with running_server(str(folder), served_model_name=MODEL, log_level="warning", **options) as u:
        yield u


def test_token_strings_join_into_the_text(tokenizer):
    text = "naïve café 東京 ok"
    ids = tokenizer.encode(text)
    tokens, alternatives = token_strings(tokenizer, [], ids, [{t: 0.0} for t in ids], ends=True)
    assert "".join(tokens) == text
    # 東 is three byte tokens: the first two add nothing, the third the whole character.
    start = tokens.index("東")
    assert tokens[start - 2 : start] == ["", ""]
    assert [names[t] for names, t in zip(alternatives, ids)] == tokens
    # In a delta, the tokens before it give the context: the same strings come out.
    rest = ids[start - 1 :]
    later, _ = token_strings(tokenizer, ids[: start - 1], rest, [{}] * len(rest), ends=True)
    assert "".join(later) == "".join(tokens[start - 1 :])


def favoured_bias(tokenizer) -> dict[str, int]:
    ids = {t for text in FAVOURED_TEXT for t in tokenizer.encode(text)}
    return {str(t): 100 for t in ids}


@pytest.mark.parametrize("stream", [False, True])
def test_completion_offsets_index_each_token(url, tokenizer, stream):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 48, "temperature": 1.0, "seed": 3,
            "logprobs": 3, "ignore_eos": True, "logit_bias": favoured_bias(tokenizer),
            "stream": stream}  # fmt: skip
    choices = completion_choices(url, body)
    text = "".join(c["text"] for c in choices)
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    tops = [top for c in choices for top in c["logprobs"]["top_logprobs"]]
    assert len(tokens) == len(offsets) == 48
    assert "".join(tokens) == text
    assert [text[o : o + len(t)] for o, t in zip(offsets, tokens)] == tokens
    assert all(token in top for token, top in zip(tokens, tops))
    # The sample holds what the test is about: spaces, whole two-byte characters, and
    # tokens that add nothing (the first byte of a character).
    assert " " in text and "é" in text and "" in tokens


def test_chat_tokens_join_into_the_content(url, tokenizer):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 32,
            "temperature": 1.0, "seed": 5, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True, "logit_bias": favoured_bias(tokenizer)}  # fmt: skip
    choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
    assert all(bytes(entry["bytes"]).decode() == entry["token"] for entry in content)


def completion_choices(url: str, body: dict) -> list[dict]:
    if not body["stream"]:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    choices = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices += httpx.Response(200, content=line[6:]).json()["choices"]
    return choices
