"""--tool-call-parser: the formats ATOM reads calls in, under vLLM's names, and the reader
one choice of a chat request gets."""

from __future__ import annotations

from collections.abc import Callable

from atom.server.protocol import ChatCompletionRequest, Tool
from atom.server.tool_calls.calls import ToolCallReader
from atom.server.tool_calls.forced import forced_call_guide
from atom.server.tool_calls.formats import (
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    GLM45,
    KIMI_K2,
    MINIMAX_M2,
    QWEN3_CODER,
    Hermes,
    XmlParameters,
)
from atom.server.tool_calls.harmony import HarmonyReader
from atom.server.tool_calls.json_calls_reader import JsonCallsReader
from atom.server.tool_calls.reader import MarkedCallReader


def _xml(format: dict) -> Callable[[list[Tool]], ToolCallReader]:
    def reader(tools: list[Tool]) -> ToolCallReader:
        schemas = {tool.function.name: tool.function.parameters or {} for tool in tools}
        return MarkedCallReader(XmlParameters(**format, schemas=schemas))

    return reader


TOOL_CALL_PARSERS: dict[str, Callable[[list[Tool]], ToolCallReader]] = {
    "hermes": lambda tools: MarkedCallReader(Hermes()),
    "llama3_json": lambda tools: JsonCallsReader(marker="<|python_tag|>", from_start="{"),
    "mistral": lambda tools: JsonCallsReader(marker="[TOOL_CALLS]"),
    "deepseek_v3": lambda tools: MarkedCallReader(DEEPSEEK_V3),
    "deepseek_v31": lambda tools: MarkedCallReader(DEEPSEEK_V31),
    "kimi_k2": lambda tools: MarkedCallReader(KIMI_K2),
    "glm45": _xml(GLM45),
    "glm47": _xml(GLM45),
    "qwen3_coder": _xml(QWEN3_CODER),
    "minimax_m2": _xml(MINIMAX_M2),
    "openai": lambda tools: HarmonyReader(),
}


def tool_call_reader(request: ChatCompletionRequest, parser: str) -> ToolCallReader | None:
    """What takes the calls out of one choice's text; None when no call can come."""
    if not request.tools or request.tool_choice == "none":
        return None
    if forced_call_guide(request) is not None:
        return JsonCallsReader(from_start="[")
    return TOOL_CALL_PARSERS[parser](request.tools)
