"""The tool-call readers of every --tool-call-parser on text: whole, and fed piece by piece
as a stream, where the pieces of each call must add up to what the whole text gives."""

from __future__ import annotations

import json

import pytest

from atom.server.protocol import ChatCompletionRequest
from atom.server.tool_calls import TOOL_CALL_PARSERS, tool_call_reader

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
PREFIX = "Let me check."

# One output of each format: PREFIX, then the two CALLS.
OUTPUTS = {
    "hermes": PREFIX + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
    "llama3_json": PREFIX + '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
    '"Paris", "days": 3}}; {"name": "get_time", "parameters": {}}',
    "mistral": PREFIX + '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}, {"name": "get_time", "arguments": {}}]',
    "deepseek_v3": PREFIX + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    'get_weather\n```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>",
    "deepseek_v31": PREFIX + "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": PREFIX + "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
    "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>",
    "glm45": PREFIX + "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
    "<tool_call>get_time</tool_call>",
    "qwen3_coder": PREFIX + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_time>\n</function>\n</tool_call>",
    "minimax_m2": PREFIX + '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter '
    'name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
    '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
    # GPT-OSS: reasoning, a preamble, then the calls (<|call|> stops an output: the last
    # call ends with the output).
    "openai": "<|channel|>analysis<|message|>The user wants weather and time.<|end|><|start|>"
    f"assistant<|channel|>commentary<|message|>{PREFIX}<|end|><|start|>assistant<|channel|>"
    "commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 3}<|call|><|start|>assistant to=functions.get_time<|channel|>'
    "commentary json<|message|>{}",
}  # fmt: skip
OUTPUTS["glm47"] = OUTPUTS["glm45"]


def reader_for(parser: str, tool_choice="auto"):
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "?"}], tools=[WEATHER, TIME], tool_choice=tool_choice
    )
    return tool_call_reader(request, parser)


def read_whole(parser: str, text: str, tool_choice="auto"):
    reader = reader_for(parser, tool_choice)
    content, _ = reader.read(text, final=True)
    return content, [(c.name, json.loads(c.arguments)) for c in reader.calls]


def read_streamed(parser: str, text: str, piece: int):
    """The content and calls the pieces add up to, and the pieces of each call."""
    reader, content, pieces = reader_for(parser), "", {}
    chunks = [text[i : i + piece] for i in range(0, len(text), piece)]
    for i, chunk in enumerate(chunks):
        more, deltas = reader.read(chunk, final=i == len(chunks) - 1)
        content += more
        for delta in deltas:
            pieces.setdefault(delta.index, []).append((i, delta))
    calls = []
    for _, call_pieces in sorted(pieces.items()):
        first = call_pieces[0][1]
        assert first.id.startswith("call_") and first.name
        assert all(d.id is None and d.name is None for _, d in call_pieces[1:])
        arguments = "".join(d.arguments for _, d in call_pieces)
        calls.append((first.name, json.loads(arguments)))
    return content, calls, pieces


def test_every_parser_has_an_output_here():
    assert OUTPUTS.keys() == TOOL_CALL_PARSERS.keys()


@pytest.mark.parametrize("parser", OUTPUTS)
def test_calls_are_taken_out_of_the_text(parser):
    content, calls = read_whole(parser, OUTPUTS[parser])
    assert content.strip() == PREFIX
    assert calls == CALLS


@pytest.mark.parametrize("parser", OUTPUTS)
def test_streamed_pieces_add_up_to_the_whole_text(parser):
    text = OUTPUTS[parser]
    for piece in (1, 2, 3, 7, 13, len(text)):
        content, calls, _ = read_streamed(parser, text, piece)
        assert (content.strip(), calls) == (PREFIX, CALLS), piece


@pytest.mark.parametrize("parser", OUTPUTS)
def test_a_call_streams_before_it_ends(parser):
    """Character by character, the first call's name is sent before its arguments are
    complete, and its arguments come in several pieces (per argument for the XML formats)."""
    text = OUTPUTS[parser]
    _, _, pieces = read_streamed(parser, text, 1)
    first_call = pieces[0]
    arguments_end = text.index("3") + 1  # the first call's last argument is complete here
    assert first_call[0][0] < text.index("Paris")
    assert sum(bool(d.arguments) for _, d in first_call) >= 2
    assert any(i < arguments_end + 20 for i, d in first_call if d.arguments)


def test_text_that_only_looks_like_a_tag_stays_content():
    reader = reader_for("hermes")
    assert reader.read("a <tool", final=False) == ("a ", [])  # may start a tag: held back
    assert reader.read("box> b", final=False) == ("<toolbox> b", [])


def test_a_block_that_is_not_a_call_stays_content():
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert read_whole("hermes", text) == (text, [])
    unfinished = 'x <tool_call>{"name": "get_weather"'
    assert read_whole("hermes", unfinished) == (unfinished, [])
    assert read_whole("llama3_json", "{not a call} and text") == ("{not a call} and text", [])
    assert read_whole("mistral", "plain text") == ("plain text", [])


def test_a_streamed_call_cut_short_ends_where_it_was_cut():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    reader = reader_for("hermes")
    _, deltas = reader.read(text, final=False)
    _, last = reader.read("", final=True)
    assert deltas[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas + last) == '{"city": "Pa'


def test_arguments_may_be_a_json_string_or_parameters():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert read_whole("hermes", text) == ("", [("f", {"a": 1})])
    text = '<tool_call>{"name": "f", "parameters": {"a": 2}}</tool_call>'
    assert read_whole("hermes", text) == ("", [("f", {"a": 2})])


def test_xml_arguments_take_their_type_from_the_tool_schema():
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>1984</arg_value>"
    text += "<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>x</arg_key>"
    text += "<arg_value>[1, 2]</arg_value></tool_call>"
    assert read_whole("glm45", text)[1] == [
        ("get_weather", {"city": "1984", "days": 2, "x": [1, 2]})
    ]


def test_llama3_json_needs_the_call_at_the_start_or_after_the_python_tag():
    assert read_whole("llama3_json", 'The answer is {"name": "get_time"}')[1] == []
    assert read_whole("llama3_json", ' {"name": "get_time", "parameters": {}}') == (
        "", [("get_time", {})]
    )  # fmt: skip


def test_forced_calls_are_a_json_array_streamed_as_they_come():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    assert read_whole("hermes", text, "required") == ("", CALLS[:1])
    reader = reader_for("hermes", "required")
    _, deltas = reader.read(text[:50], final=False)
    assert deltas[0].name == "get_weather" and deltas[0].arguments.startswith('{"city"')
    assert read_whole("hermes", '[{"name": "f", "argu', "required") == ('[{"name": "f", "argu', [])
    assert read_whole("hermes", "[1]", "required") == ("[1]", [])


def test_harmony_final_channel_is_the_content_and_analysis_is_not():
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
    text += "<|message|>It is sunny."
    assert read_whole("openai", text) == ("It is sunny.", [])
    for piece in (1, 4):
        assert read_streamed("openai", text, piece)[:2] == ("It is sunny.", [])
