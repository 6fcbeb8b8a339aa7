"""Every bad request gets an OpenAI-style 4xx error naming the problem, and the server
keeps serving: a good request right after each one succeeds."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.server_process import MODEL

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOO_LONG = "the " * 300  # max_model_len is 256
HI = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = {
    "unknown model": (COMPLETIONS, {"model": "gpt-9", "prompt": "a"}, 404, "gpt-9"),
    "prompt too long": (COMPLETIONS, {"prompt": TOO_LONG}, 400, "max_model_len"),
    "token ids out of range": (COMPLETIONS, {"prompt": [1, 10**6]}, 400, "token ids"),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400, "empty"),
    "negative temperature": (COMPLETIONS, {"prompt": "a", "temperature": -1}, 400, "temperature"),
    "top_p above 1": (COMPLETIONS, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    "n of 0": (COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n must"),
    "max_tokens of 0": (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "min above max": (COMPLETIONS, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400,
                      "min_tokens"),
    "too many logprobs": (COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    "max_tokens not a number": (COMPLETIONS, {"prompt": "a", "max_tokens": "ten"}, 400,
                                "max_tokens"),
    "prompt an object": (COMPLETIONS, {"prompt": {"text": "a"}}, 400, "prompt"),
    "stop a number": (COMPLETIONS, {"prompt": "a", "stop": 5}, 400, "stop"),
    "malformed JSON": (COMPLETIONS, b'{"prompt": "a",', 400, "malformed JSON"),
    "not JSON": (COMPLETIONS, b"prompt=a", 400, "JSON object"),
    "chat without messages": (CHAT, {"model": MODEL}, 400, "messages"),
    "messages a string": (CHAT, {"messages": "hi"}, 400, "messages"),
    "chat too long": (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, 400,
                      "max_model_len"),
    "chat unknown model": (CHAT, {"model": "gpt-9", "messages": HI}, 404, "gpt-9"),
    "top_logprobs alone": (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    "unknown route": ("/v1/embeddings", {"input": "a"}, 404, "/v1/embeddings"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_error_and_server_keeps_serving(case, server, client):
    path, body, status, named = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        content_type = "application/json" if case == "malformed JSON" else "text/plain"
        response = httpx.post(
            server + path, content=body, headers={"content-type": content_type}, timeout=30
        )
    else:
        response = httpx.post(server + path, json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert named in error["message"]
    assert error["type"] == "invalid_request_error"
    good = client.completions.create(model=MODEL, prompt="a small cat", max_tokens=2)
    assert good.usage.completion_tokens >= 1


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-9", prompt="a")
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-1, stream=True)
