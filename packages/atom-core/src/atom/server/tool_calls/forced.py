"""A forced tool_choice ("required" or a named function): guided decoding makes the output
a JSON array of `{"name", "arguments"}` objects, whatever the model's own format."""

from __future__ import annotations

from atom.server.errors import APIError
from atom.server.guided_protocol import GuideSpec
from atom.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool


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
