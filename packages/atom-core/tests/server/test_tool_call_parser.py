"""The Hermes/Qwen tool-call readers on text: whole, and fed piece by piece as a stream."""

from __future__ import annotations

import json

from atom.server.tools import ForcedCallReader, HermesToolCallReader

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}\n"


def read_whole(text: str, reader=None):
    reader = reader or HermesToolCallReader()
    content, calls = reader.read(text, final=True)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def read_streamed(text: str, piece: int):
    reader, content, calls = HermesToolCallReader(), "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for i, chunk in enumerate(pieces):
        more, new = reader.read(chunk, final=i == len(pieces) - 1)
        content += more
        calls += [(c.name, json.loads(c.arguments)) for c in new]
    return content, calls


def test_calls_are_taken_out_of_the_text():
    content, calls = read_whole(TEXT)
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_streaming_gives_what_the_whole_text_gives():
    for piece in (1, 2, 5, 13, len(TEXT)):
        assert read_streamed(TEXT, piece) == read_whole(TEXT)


def test_text_that_only_looks_like_a_tag_stays_content():
    reader = HermesToolCallReader()
    assert reader.read("a <tool", final=False) == ("a ", [])  # may start a tag: held back
    assert reader.read("box> b", final=False) == ("<toolbox> b", [])


def test_a_block_that_is_not_a_call_stays_content():
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert read_whole(text) == (text, [])
    unfinished = 'x <tool_call>{"name": "get_weather"'
    assert read_whole(unfinished) == (unfinished, [])


def test_arguments_may_be_a_json_string_or_parameters():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert read_whole(text) == ("", [("f", {"a": 1})])
    text = '<tool_call>{"name": "f", "parameters": {"a": 2}}</tool_call>'
    assert read_whole(text) == ("", [("f", {"a": 2})])


def test_forced_calls_are_a_json_array_read_at_the_end():
    reader = ForcedCallReader()
    assert reader.read('[{"name": "f", "argu', final=False) == ("", [])
    assert read_whole('ments": {"a": 1}}]', reader) == ("", [("f", {"a": 1})])
    assert read_whole('[{"name": "f", "argu') == ('[{"name": "f", "argu', [])
    assert ForcedCallReader().read("[1]", final=True) == ("[1]", [])
