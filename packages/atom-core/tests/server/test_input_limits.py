"""Bounds and bad input: every bad request gets a 4xx whose error names the field at
fault, huge requests are refused before they cost anything, and other clients' streams
keep flowing meanwhile."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.conftest import MAX_BODY_BYTES, MAX_N
from tests.server.server_process import MODEL

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HUGE_PROMPT = "river " * 1_700_000  # 10 MB of text
JSON = {"content-type": "application/json"}
HI = [{"role": "user", "content": "a"}]


def nested(depth: int) -> str:
    """A completion body whose prompt is `depth` arrays deep (the body itself one more)."""
    return '{"prompt": ' + "[" * depth + "]" * depth + "}"


def with_tool_parameters(parameters: dict) -> dict:
    function = {"name": "f", "parameters": parameters}
    return {"messages": HI, "tools": [{"type": "function", "function": function}],
            "tool_choice": "auto"}  # fmt: skip


def raw(text: str) -> bytes:
    """A body written by hand: JSON that json.dumps would never produce."""
    return text.encode("utf-8", errors="surrogatepass")


# name: (path, body, status, param, words in the message)
BAD_REQUESTS = {
    "unknown field": (COMPLETIONS, {"prompt": "a", "temprature": 0}, 400, "temprature",
                      "unknown field"),
    "unknown nested field": (CHAT, {"messages": [{"role": "user", "content": "a", "x": 1}]},
                             400, "messages.0.x", "unknown field"),
    "unknown stream option": (COMPLETIONS, {"prompt": "a", "stream": True,
                              "stream_options": {"usage": True}}, 400, "stream_options.usage",
                              "unknown field"),
    "logit_bias": (COMPLETIONS, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias.5",
                   "less than or equal to 100"),
    "functions": (CHAT, {"messages": [{"role": "user", "content": "a"}],
                  "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    "tools": (CHAT, {"messages": [{"role": "user", "content": "a"}], "tools": [{"x": 1}]},
              400, "tools.0.type", "Field required"),
    "n above the maximum": (COMPLETIONS, {"prompt": "a", "n": MAX_N + 1}, 400, "n", "--max-n"),
    "n of a billion": (CHAT, {"messages": [{"role": "user", "content": "a"}], "n": 10**9},
                       400, "n", "--max-n"),
    "best_of above the maximum": (COMPLETIONS, {"prompt": "a", "n": 1, "best_of": 10**9}, 400,
                                  "best_of", "--max-n"),
    "prompts times n": (COMPLETIONS, {"prompt": ["a"] * 5, "n": 2}, 400, "prompt",
                        "make 10 choices"),
    "top_p of 0": (COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p", "top_p must"),
    "min_p above 1": (COMPLETIONS, {"prompt": "a", "min_p": 2}, 400, "min_p", "min_p must"),
    "presence_penalty below -2": (CHAT, {"messages": [{"role": "user", "content": "a"}],
                                  "presence_penalty": -3}, 400, "presence_penalty", "[-2, 2]"),
    "repetition_penalty of 0": (COMPLETIONS, {"prompt": "a", "repetition_penalty": 0}, 400,
                                "repetition_penalty", "> 0"),
    "negative seed": (COMPLETIONS, {"prompt": "a", "seed": -1}, 400, "seed", "seed"),
    "temperature NaN": (COMPLETIONS, raw('{"prompt": "a", "temperature": NaN}'), 400,
                        "temperature", "finite"),
    "temperature overflowing": (COMPLETIONS, raw('{"prompt": "a", "temperature": 1e999}'), 400,
                                "temperature", "finite"),
    "lone surrogate": (COMPLETIONS, raw('{"prompt": "a \\ud800 b"}'), 400, "prompt", "UTF-8"),
    "invalid UTF-8": (COMPLETIONS, b'{"prompt": "a \xff b"}', 400, "prompt", "UTF-8"),
    "surrogate in a message": (CHAT, raw('{"messages": [{"role": "user", "content": "\\udc00"}]}'),
                               400, "messages.0.content", "UTF-8"),
    "surrogate in a batch": (COMPLETIONS, raw('{"prompt": ["a", "\\ud83d"]}'), 400, "prompt.1",
                             "UTF-8"),
    "token prompt too long": (COMPLETIONS, {"prompt": [5] * 300}, 400, "prompt", "300 tokens"),
    "huge prompt": (COMPLETIONS, {"prompt": HUGE_PROMPT}, 400, "prompt", "10200000 characters"),
    "huge chat": (CHAT, {"messages": [{"role": "user", "content": HUGE_PROMPT}]}, 400,
                  "messages", "10200000 characters"),
    "body over the limit": (COMPLETIONS, {"prompt": "a " * (MAX_BODY_BYTES // 2)}, 413, None,
                            "--max-request-body-bytes"),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "a"}]}, 400,
                     "messages.0.role", "'system', 'developer', 'user', 'assistant'"),
    "tool parameters of an unknown type": (CHAT, with_tool_parameters(
        {"type": "object", "properties": {"x": {"type": "strng"}}}), 400,
        "tools.0.function.parameters", "properties.x.type: 'strng' is not a JSON type"),
    "tool parameters' properties a number": (CHAT, with_tool_parameters(
        {"type": "object", "properties": 5}), 400, "tools.0.function.parameters",
        "properties: must be an object of schemas"),
    "tool parameters' required a string": (CHAT, with_tool_parameters(
        {"type": "object", "required": "x"}), 400, "tools.0.function.parameters",
        "required: must be a list of property names"),
    "key given twice": (COMPLETIONS, raw('{"prompt": "a", "max_tokens": 2, "max_tokens": 3}'),
                        400, None, "'max_tokens' appears twice"),
    "key given twice in a message": (CHAT, raw('{"messages": [{"role": "user", "content": "a", '
                                     '"role": "system"}]}'), 400, None, "'role' appears twice"),
    "nested 100,000 deep": (COMPLETIONS, raw(nested(100_000)), 400, None, "128 levels deep"),
    "nested 129 deep": (COMPLETIONS, raw(nested(128)), 400, None, "128 levels deep"),
    "more stop strings than the limit": (COMPLETIONS, {"prompt": "a", "stop": ["x"] * 65}, 400,
                                         "stop", "stop has 65 strings; the limit is 64"),
    "stop strings longer than the limit": (COMPLETIONS, {"prompt": "a", "stop": ["x" * 9000] * 2},
                                           400, "stop", "stop has 18000 characters in all; "
                                           "the limit is 16384 (--max-stop-chars)"),
    "detokenize unknown ids": ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens",
                               "tokens must be"),
    "tokenize neither": ("/tokenize", {"add_special_tokens": False}, 400, None,
                         "exactly one of prompt and messages"),
}  # fmt: skip


def post(server: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server + path, content=content, headers=JSON, timeout=60)


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_names_its_field(case, server, client):
    path, body, status, param, words = BAD_REQUESTS[case]
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert words in error["message"]
    good = client.completions.create(model=MODEL, prompt="a small cat", max_tokens=2)
    assert good.usage.completion_tokens >= 1


def test_deep_bodies_and_rich_tool_schemas_within_bounds_are_served(server):
    """The refusals above stop at their bounds: a body 128 levels deep, and a tool schema
    using booleans, $defs, $ref, anyOf and draft-4 flags, are served."""
    template_kwargs = {}
    for _ in range(126):  # the body, chat_template_kwargs, then 126 objects: 128 levels
        template_kwargs = {"unused": template_kwargs}
    deep = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": template_kwargs}
    schema = {
        "type": "object",
        "$defs": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2}},
        "properties": {
            "at": {"$ref": "#/$defs/point"},
            "mode": {"anyOf": [{"enum": ["fast", "slow"]}, {"type": "null"}]},
            "count": {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": True},
            "extra": True,
        },
        "required": ["at"],
        "additionalProperties": False,
    }
    rich = {**with_tool_parameters(schema), "max_tokens": 1}
    for body in (deep, rich):
        response = post(server, CHAT, body)
        assert response.status_code == 200, response.text


def test_stop_strings_up_to_the_limit_stop_where_the_first_one_ends(client):
    """64 stop strings (--max-stop-strings' default), most never met: the output stops at
    the one that ends first, whatever its place in the list."""
    kwargs = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 24, "seed": 5,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = client.completions.create(**kwargs).choices[0].text
    words = full.split()
    early, late = f" {words[3]}", f" {words[8]}"
    cut = full.index(early) if early in full[: full.index(late)] else full.index(late)
    stops = [f"never {i}" for i in range(62)] + [late, early]
    choice = client.completions.create(**kwargs, stop=stops).choices[0]
    assert (choice.text, choice.finish_reason) == (full[:cut], "stop")


def test_null_means_default_and_null_max_tokens_means_the_context(client):
    response = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=None, temperature=None,
        top_p=None, n=None, seed=None, stop=None, extra_body={"ignore_eos": True, "top_k": None},
    )  # fmt: skip
    assert response.usage.total_tokens == 256  # max_model_len
    assert response.choices[0].finish_reason == "length"
    omitted = client.completions.create(model=MODEL, prompt="a", extra_body={"ignore_eos": True})
    assert omitted.usage.completion_tokens == 16


def test_streams_keep_flowing_while_huge_and_bad_requests_are_refused(server):
    """A long stream runs while another client sends a 10 MB prompt, an oversized body, an
    unbounded n and a lone surrogate, over and over: each gets its 4xx, the stream gets
    tokens between the refusals, and it delivers every token."""
    events = asyncio.run(stream_beside_refusals(server))
    first_refusal = events.index("refused")
    assert first_refusal < events.index("end")
    assert "token" in events[first_refusal : events.index("end")]


async def stream_beside_refusals(server: str) -> list[str]:
    bad = [BAD_REQUESTS[c] for c in ("huge prompt", "body over the limit", "n of a billion",
                                     "lone surrogate")]  # fmt: skip
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0, timeout=60)
    events: list[str] = []

    async def stream() -> int:
        chunks = await client.completions.create(
            model=MODEL, prompt="a river", max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        received = 0
        async for chunk in chunks:
            received += len(chunk.choices[0].token_ids)
            events.append("token")
        events.append("end")
        return received

    async def refused(http: httpx.AsyncClient, path: str, body, status: int) -> None:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await http.post(server + path, content=content, headers=JSON)
        assert response.status_code == status
        events.append("refused")

    streaming = asyncio.create_task(stream())
    async with httpx.AsyncClient(timeout=60) as http:
        while "token" not in events:
            await asyncio.sleep(0.01)
        for _ in range(3):
            for path, body, status, _, _ in bad:
                await refused(http, path, body, status)
    assert await streaming == 200
    return events
