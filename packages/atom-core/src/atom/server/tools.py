"""Tool calling, Hermes/Qwen style.

The chat template renders the request's `tools`; the model answers with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, which a reader takes out of
the text (as it streams, or whole). `tool_choice` "required" or a named function forces a
call through guided decoding instead: the output must then be a JSON array of
`{"name", "arguments"}` objects, which the reader parses once the output ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from atom.server.errors import APIError
from atom.server.guided_protocol import GuideSpec
from atom.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def forced_call_guide(request: ChatCompletionRequest) -> GuideSpec | None:
    """The guide that makes the output a valid call, for tool_choice required or named."""
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if not request.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    tools = request.tools
    if isinstance(choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
        if not tools:
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice.function.name",
            )
    calls = [_call_schema(tool) for tool in tools]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return GuideSpec("json", {"type": "array", "minItems": 1, "items": items}, "tool_choice")


def _call_schema(tool: Tool) -> dict:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
    }


def tool_call_reader(
    request: ChatCompletionRequest,
) -> HermesToolCallReader | ForcedCallReader | None:
    """What takes the calls out of one choice's text; None when no call can come."""
    if not request.tools or request.tool_choice == "none":
        return None
    if forced_call_guide(request) is not None:
        return ForcedCallReader()
    return HermesToolCallReader()


def _parse_call(payload) -> ParsedToolCall | None:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(payload["name"], arguments)


class HermesToolCallReader:
    """Splits text, fed piece by piece, into content and `<tool_call>` blocks. Text that may
    be the start of a block is held back until it is known; a block whose body is not a
    call stays content."""

    def __init__(self):
        self.pending = ""
        self.num_calls = 0

    def read(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        """The content and calls completed by `text`; with final, everything left."""
        self.pending += text
        content, calls = [], []
        while True:
            start = self.pending.find(TOOL_CALL_START)
            end = self.pending.find(TOOL_CALL_END, start) if start >= 0 else -1
            if end < 0:
                cut = len(self.pending) if final else self._safe_end(start)
                content.append(self._content(self.pending[:cut]))
                self.pending = self.pending[cut:]
                break
            call = _parse_json_call(self.pending[start + len(TOOL_CALL_START) : end])
            stop = end + len(TOOL_CALL_END)
            content.append(self._content(self.pending[: start if call else stop]))
            if call is not None:
                calls.append(call)
                self.num_calls += 1
            self.pending = self.pending[stop:]
        return "".join(content), calls

    def _content(self, text: str) -> str:
        # Between and after calls, models write newlines: no content worth a message.
        return "" if self.num_calls and not text.strip() else text

    def _safe_end(self, start: int) -> int:
        """Where the text that cannot belong to a block ends."""
        if start >= 0:
            return start
        for keep in range(min(len(TOOL_CALL_START) - 1, len(self.pending)), 0, -1):
            if TOOL_CALL_START.startswith(self.pending[-keep:]):
                return len(self.pending) - keep
        return len(self.pending)


def _parse_json_call(body: str) -> ParsedToolCall | None:
    try:
        return _parse_call(json.loads(body))
    except json.JSONDecodeError:
        return None


class ForcedCallReader:
    """The whole output is a JSON array of calls (tool_choice required or named); it is
    read when the output ends. An output cut short (max_tokens) stays content."""

    def __init__(self):
        self.pending = ""
        self.num_calls = 0

    def read(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        self.pending += text
        if not final:
            return "", []
        try:
            calls = [_parse_call(item) for item in json.loads(self.pending)]
        except (json.JSONDecodeError, TypeError):
            calls = [None]
        if None in calls:
            return self.pending, []
        self.num_calls += len(calls)
        return "", calls
