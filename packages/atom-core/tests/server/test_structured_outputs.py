"""logit_bias, guided decoding and tool calling against a real server over a tiny random
Llama with a byte-level tokenizer: with random weights, only the masks make the outputs
valid JSON, match the regex or name a tool."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from atom.server.errors import APIError
from atom.server.guided import GuidedDecoding
from atom.server.guided_protocol import GuideSpec
from tests.server.byte_level_model import VOCAB_SIZE, build_tokenizer, write_byte_level_model
from tests.server.server_process import running_server

MODEL = "byte-level"
HASH = 5  # the token id of "#"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "color"],
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.com"
CHOICES = ["yes", "no", "maybe"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    folder = write_byte_level_model(tmp_path_factory.mktemp("byte-level"))
    options = {"dtype": "float32", "block_size": 16, "num_blocks": 256}
    with running_server(str(folder), served_model_name=MODEL, log_level="warning", **options) as u:
        yield u


def post(url: str, path: str, **body) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 96, **body}
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=120)


def chat(url: str, **body) -> dict:
    response = post(url, "chat/completions", messages=MESSAGES, **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def completion_texts(url: str, **body) -> list[str]:
    response = post(url, "completions", prompt="The answer:", **body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert {c["finish_reason"] for c in choices} == {"stop"}
    return [c["text"] for c in choices]


def assert_matches_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["ok", "n", "color"]
    assert isinstance(value["ok"], bool)
    assert type(value["n"]) is int and 0 <= value["n"] <= 99
    assert value["color"] in ("red", "green", "blue")


def streamed_chat(url: str, **body) -> list[dict]:
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line)["choices"][0] for line in lines[:-1]]


def test_logit_bias_forces_a_token(url):
    response = post(
        url, "completions", prompt="Hi", max_tokens=5, logit_bias={str(HASH): 100},
        return_token_ids=True,
    )  # fmt: skip
    assert response.json()["choices"][0]["token_ids"] == [HASH] * 5
    assert chat(url, max_tokens=4, logit_bias={str(HASH): 100})["message"]["content"] == "####"


@pytest.mark.parametrize(
    "logit_bias",
    [{"abc": 1}, {"5": 101}, {"5": -100.5}, {str(VOCAB_SIZE): 1}, {"5": "high"}],
)
def test_bad_logit_bias_is_refused_naming_the_field(url, logit_bias):
    response = post(url, "completions", prompt="Hi", logit_bias=logit_bias)
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith("logit_bias")


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA},
    ],
    ids=["response_format", "structured_outputs", "guided_json"],
)
def test_json_schema_output_validates(url, constraint):
    assert_matches_schema(chat(url, **constraint)["message"]["content"])
    for text in completion_texts(url, n=3, temperature=1.0, seed=7, **constraint):
        assert_matches_schema(text)


def test_json_object_output_parses(url):
    # A strong bias on "}" makes the model close the object as soon as the grammar lets it;
    # without the grammar, the same bias writes "}" first.
    close_brace = {"95": 100}
    (text,) = completion_texts(url, response_format={"type": "json_object"}, logit_bias=close_brace)
    assert json.loads(text) == {}
    unguided = post(url, "completions", prompt="The answer:", max_tokens=3, logit_bias=close_brace)
    assert unguided.json()["choices"][0]["text"] == "}}}"


def test_regex_and_choice_outputs(url):
    for regex in ({"structured_outputs": {"regex": EMAIL}}, {"guided_regex": EMAIL}):
        texts = completion_texts(url, n=3, temperature=1.0, seed=1, **regex)
        assert all(re.fullmatch(EMAIL, text) for text in texts), texts
    for choice in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        answer = chat(url, logprobs=True, top_logprobs=20, **choice)
        assert answer["message"]["content"] in CHOICES
        # Masked tokens have logprob -inf, which JSON cannot carry: written as the floor.
        floors = [t["logprob"] for t in answer["logprobs"]["content"][0]["top_logprobs"]]
        assert min(floors) == -9999.0
        texts = completion_texts(url, n=4, temperature=1.5, seed=3, **choice)
        assert set(texts) <= set(CHOICES)


def test_streamed_json_schema_output(url):
    chunks = streamed_chat(url, structured_outputs={"json": SCHEMA}, max_tokens=96)
    assert_matches_schema("".join(c["delta"].get("content") or "" for c in chunks))
    assert chunks[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "(["}, "guided_regex"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_constraints_are_refused_naming_the_field(url, body, param):
    response = post(url, "chat/completions", messages=MESSAGES, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_guided_decoding_needs_a_tokenizer():
    guided = GuidedDecoding(None, VOCAB_SIZE, [2])
    with pytest.raises(APIError, match="--skip-tokenizer-init") as error:
        guided.guide_factory(GuideSpec("regex", "a+", "guided_regex"))
    assert error.value.status == 400


def test_a_guide_per_completion_walks_its_own_grammar():
    tokenizer = build_tokenizer()
    factory = GuidedDecoding(tokenizer, VOCAB_SIZE, [2]).guide_factory(
        GuideSpec("choice", CHOICES, "guided_choice")
    )
    first, second = factory(), factory()
    for token in tokenizer.encode("maybe"):
        assert first.allowed_tokens(VOCAB_SIZE)[token]
        first.accept(token)
    first.accept(tokenizer.eos_token_id)
    assert first.is_done and not second.is_done
    allowed = second.allowed_tokens(VOCAB_SIZE).nonzero().flatten().tolist()
    starts = {tokenizer.decode([t]) for t in allowed}
    assert {"y", "n", "m"} <= starts
    assert all(any(choice.startswith(start) for choice in CHOICES) for start in starts)


def assert_weather_calls(tool_calls: list[dict]) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


def assembled_calls(chunks: list[dict]) -> list[dict]:
    """The calls a stream's tool-call pieces add up to, as a client puts them together."""
    calls = {}
    for piece in [call for c in chunks for call in c["delta"].get("tool_calls") or []]:
        if piece["index"] not in calls:
            assert piece["index"] == len(calls)
            calls[piece["index"]] = {k: v for k, v in piece.items() if k != "index"}
        else:
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return list(calls.values())


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_gives_a_valid_call(url, tool_choice):
    tools = [WEATHER, TIME] if tool_choice != "required" else [WEATHER]
    choice = chat(url, tools=tools, tool_choice=tool_choice)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert_weather_calls(choice["message"]["tool_calls"])
    chunks = streamed_chat(url, tools=tools, tool_choice=tool_choice, max_tokens=96)
    assert_weather_calls(assembled_calls(chunks))
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_streamed_calls_send_their_arguments_as_they_come(url):
    """tool_choice auto; a regex makes the model write one Hermes call. As vLLM streams it:
    a first piece with id, type and name, then the arguments in pieces, and no chunk that
    the call's text left empty."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = {"tools": [WEATHER], "guided_regex": re.escape(call)}
    whole = chat(url, **body)
    assert (whole["finish_reason"], whole["message"]["content"]) == ("tool_calls", None)
    assert_weather_calls(whole["message"]["tool_calls"])
    chunks = streamed_chat(url, **body)
    deltas = [call for c in chunks for call in c["delta"].get("tool_calls") or []]
    first, rest = deltas[0], deltas[1:]
    assert (first["type"], first["function"]["name"]) == ("function", "get_weather")
    assert len(rest) >= 2 and all(d.keys() == {"index", "function"} for d in rest)
    assert all(d["function"].keys() == {"arguments"} for d in rest)
    assert_weather_calls(assembled_calls(chunks))
    for chunk in chunks:
        delta = chunk["delta"]
        assert delta.get("content") or delta.get("tool_calls") or delta.get("role") or (
            chunk["finish_reason"]
        )  # fmt: skip
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_tools_are_rendered_through_the_chat_template(url):
    plain = post(url, "chat/completions", messages=MESSAGES, max_tokens=1).json()
    with_tools = post(url, "chat/completions", messages=MESSAGES, max_tokens=1, tools=[WEATHER])
    tool_text = json.dumps(WEATHER, separators=(", ", ": "))
    grown = with_tools.json()["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert grown >= len(build_tokenizer().encode(tool_text)) // 2
    none = chat(url, tools=[WEATHER], tool_choice="none", logit_bias={str(HASH): 100}, max_tokens=3)
    assert (none["message"]["content"], none["message"]["tool_calls"]) == ("###", [])


@pytest.mark.parametrize(
    "body, message",
    [
        ({"guided_regex": "(ab"}, "guided_regex: cannot compile: Regex parsing error at "
                                  "position 4: The parenthesis is not closed."),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}},
         'response_format.json_schema.schema: cannot compile: Unsupported type "nonsense"'),
    ],
)  # fmt: skip
def test_guide_errors_name_the_problem_without_library_details(url, body, message):
    """xgrammar's own messages start with a time and its C++ source location."""
    response = post(url, "chat/completions", messages=MESSAGES, **body)
    assert response.status_code == 400 and response.json()["error"]["message"] == message
