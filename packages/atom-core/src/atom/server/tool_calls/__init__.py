"""Tool calls: the chat template renders the request's `tools`; the model answers in its
family's format, which a reader takes out of the text, as it streams or whole."""

from atom.server.tool_calls.calls import ParsedToolCall, ToolCallDelta
from atom.server.tool_calls.forced import forced_call_guide
from atom.server.tool_calls.parsers import TOOL_CALL_PARSERS, ToolCallReader, tool_call_reader

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedToolCall",
    "ToolCallDelta",
    "ToolCallReader",
    "forced_call_guide",
    "tool_call_reader",
]
