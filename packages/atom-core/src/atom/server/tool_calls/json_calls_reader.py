"""Calls written as a run of JSON call objects rather than in marked blocks: after a marker
(Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`), or from the output's first character
(the array a forced tool_choice guides the output into; Llama 3's bare `{"name": ...}`).

Text before the calls is content. After them, the objects are read one by one as they
close, and streamed while they grow. Read whole, the calls count only when every object is
one; otherwise the whole output stays content, as the model wrote it.
"""

from __future__ import annotations

import json

from atom.server.tool_calls.calls import ToolCallDelta, ToolCallReader, merged
from atom.server.tool_calls.json_call import (
    call_of,
    finish_call_object,
    partial_call_object,
    whole_call_object,
)
from atom.server.tool_calls.reader import safe_end


class JsonCallsReader(ToolCallReader):
    def __init__(self, marker: str | None = None, from_start: str = ""):
        """marker: the calls follow it; from_start: the output's first non-blank character
        starts the calls when it is one of these."""
        super().__init__()
        self.marker, self.from_start = marker, from_start
        self.markers = (marker,) if marker else ()
        self.in_calls = False
        self.trigger = ""  # the marker the calls followed
        self.seen_content = False
        self.scanned = self.depth = 0
        self.in_string = self.escaped = False
        self.object_start = 0

    def read(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.pending += text
        content = "" if self.in_calls else self._content_before_calls(final)
        if not self.in_calls:
            return content, []
        if final and not self.log.calls:
            return self._read_whole(content)
        return content, merged(self._scan(final))

    def _content_before_calls(self, final: bool) -> str:
        if self.from_start and not self.seen_content:
            stripped = self.pending.lstrip()
            if not stripped and not final:
                return ""  # only blanks so far
            if stripped and stripped[0] in self.from_start:
                self.in_calls, self.pending = True, stripped
                return ""
            self.seen_content = True
        start = self.pending.find(self.marker) if self.marker else -1
        if start >= 0:
            content, self.pending = self.pending[:start], self.pending[start + len(self.marker) :]
            self.in_calls, self.trigger = True, self.marker
            return content
        cut = len(self.pending)
        if self.marker and not final:
            cut = safe_end(self.pending, (self.marker,))
        content, self.pending = self.pending[:cut], self.pending[cut:]
        return content

    def _read_whole(self, content: str) -> tuple[str, list[ToolCallDelta]]:
        """The calls of a whole output, or its text when they are not all calls."""
        text, self.pending = self.pending, ""
        calls = [call_of(item) for item in _json_values(text)]
        if not calls or None in calls:
            return content + self.trigger + text, []
        return content, [delta for call in calls for delta in self.log.whole(*call)]

    def _scan(self, final: bool) -> list[ToolCallDelta]:
        deltas = []
        text = self.pending
        for i in range(self.scanned, len(text)):
            char = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char == "{":
                self.object_start = i if self.depth == 0 else self.object_start
                self.depth += 1
            elif char == "}" and self.depth:
                self.depth -= 1
                if self.depth == 0:
                    deltas += self._close(text[self.object_start : i + 1])
        self.scanned = len(text)
        if self.depth:
            body = text[self.object_start :]
            if self.log.streaming and final:
                deltas += self.log.close(finish_call_object(body))
            elif not final and (known := partial_call_object(body)) is not None:
                deltas += self.log.stream(*known)
        return deltas

    def _close(self, body: str) -> list[ToolCallDelta]:
        if self.log.streaming:
            return self.log.close(finish_call_object(body))
        call = whole_call_object(body)
        return self.log.whole(*call) if call is not None else []


def _json_values(text: str) -> list:
    """The JSON values of `text`: one array's items, or values one after another (Llama 3
    separates several calls with `;`); [None] where the text is not such JSON."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [None]
        values.append(value)
    if len(values) == 1 and isinstance(values[0], list):
        return values[0]
    return values
