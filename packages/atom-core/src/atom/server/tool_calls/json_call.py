"""One call written as a JSON object, `{"name": ..., "arguments": {...}}` (or
"parameters"), whole or as it grows: the arguments stream once the name is known."""

from __future__ import annotations

import json
import re

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def call_of(payload) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; None when it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return payload["name"], arguments


def whole_call_object(body: str) -> tuple[str, str] | None:
    try:
        return call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def partial_call_object(body: str) -> tuple[str, str] | None:
    head = _HEAD.match(body)
    if head is None:
        return None
    # What follows may be the arguments' and the object's closing braces.
    return json.loads(f'"{head.group(1)}"'), body[head.end() :].rstrip(" \t\r\n}")


def finish_call_object(body: str) -> str:
    text = body[_HEAD.match(body).end() :].rstrip()
    if text.endswith("}") and _is_json(text[:-1]):
        return text[:-1].rstrip()
    return text  # cut short before the object closed


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
