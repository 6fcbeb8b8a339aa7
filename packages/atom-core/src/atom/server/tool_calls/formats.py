"""The tool-call formats of the families ATOM serves, under vLLM's --tool-call-parser
names. Each says how its calls are marked and how a call's body gives its name and
arguments (formats.md in docs/serving.md shows one call of each)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from atom.server.tool_calls.json_call import (
    finish_call_object,
    partial_call_object,
    whole_call_object,
)


class Hermes:
    """Hermes, Qwen2.5/Qwen3 (`hermes`):
    `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`."""

    start, end, grouping = "<tool_call>", "</tool_call>", ()
    whole = staticmethod(whole_call_object)
    partial = staticmethod(partial_call_object)
    finish = staticmethod(finish_call_object)


@dataclass
class NamedJsonArguments:
    """A name, then the arguments as JSON text: DeepSeek-V3 (`deepseek_v3`:
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`),
    DeepSeek-V3.1 (`deepseek_v31`: `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`),
    Kimi-K2 (`kimi_k2`:
    `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`)."""

    start: str
    end: str
    grouping: tuple[str, ...]
    head: re.Pattern  # the text up to the arguments; its group "name" is the function's
    closing: str = ""  # written after the arguments, inside the block

    def partial(self, body: str) -> tuple[str, str] | None:
        head = self.head.match(body)
        if head is None:
            return None
        arguments = body[head.end() :].lstrip()
        return head["name"].strip(), arguments.rstrip(" \t\r\n" + self.closing)

    def finish(self, body: str) -> str:
        arguments = body[self.head.match(body).end() :].strip()
        if self.closing and arguments.endswith(self.closing):
            arguments = arguments[: -len(self.closing)].rstrip()
        return arguments

    def whole(self, body: str) -> tuple[str, str] | None:
        head = self.head.match(body)
        if head is None:
            return None
        try:
            arguments = json.loads(self.finish(body))
        except json.JSONDecodeError:
            return None
        return head["name"].strip(), json.dumps(arguments, ensure_ascii=False)


DEEPSEEK_GROUPING = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V3 = NamedJsonArguments(
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", DEEPSEEK_GROUPING,
    re.compile(r"[^<]*<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n"), closing="```",
)  # fmt: skip
DEEPSEEK_V31 = NamedJsonArguments(
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", DEEPSEEK_GROUPING,
    re.compile(r"(?P<name>[^<]*)<｜tool▁sep｜>"),
)  # fmt: skip
KIMI_K2 = NamedJsonArguments(
    "<|tool_call_begin|>", "<|tool_call_end|>",
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    re.compile(r"\s*(?:functions\.)?(?P<name>[^:<]*)(?::\d+)?\s*<\|tool_call_argument_begin\|>"),
)  # fmt: skip


@dataclass
class XmlParameters:
    """A name, then each argument in tags of its own: GLM-4.5 to GLM-5 (`glm45`:
    `<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`), Qwen3-Coder
    and Qwen3.5 (`qwen3_coder`: `<tool_call><function=f><parameter=k>v</parameter>
    </function></tool_call>`), MiniMax-M2 (`minimax_m2`: `<minimax:tool_call><invoke
    name="f"><parameter name="k">v</parameter></invoke></minimax:tool_call>`).

    A value stays a string where the tool's schema says string (or says nothing and the
    value is not JSON); otherwise it is the JSON it spells. The arguments stream one whole
    argument at a time."""

    start: str
    end: str
    grouping: tuple[str, ...]
    name: re.Pattern  # the function's name, in its group "name", once it is known whole
    argument: re.Pattern  # one whole argument: groups "key" and "value"
    bare_name: re.Pattern | None = None  # a whole body that is a name and no arguments
    trim_newlines: bool = False  # a value's first and last newline are the format's
    schemas: dict[str, dict] = field(default_factory=dict)  # tool name -> its parameters

    def partial(self, body: str) -> tuple[str, str] | None:
        name = self.name.search(body)
        if name is None:
            return None
        arguments = self._arguments(name["name"].strip(), body[name.end() :])
        return name["name"].strip(), arguments[:-1]  # without the closing brace

    def finish(self, body: str) -> str:
        return self.whole(body)[1]

    def whole(self, body: str) -> tuple[str, str] | None:
        name = self.name.search(body) or (self.bare_name and self.bare_name.match(body))
        if name is None:
            return None
        return name["name"].strip(), self._arguments(name["name"].strip(), body[name.end() :])

    def _arguments(self, tool: str, text: str) -> str:
        properties = self.schemas.get(tool, {}).get("properties", {})
        values = {}
        for argument in self.argument.finditer(text):
            key, value = argument["key"].strip(), argument["value"]
            if self.trim_newlines:
                value = value.removeprefix("\n").removesuffix("\n")
            values[key] = _typed(value, properties.get(key, {}))
        return json.dumps(values, ensure_ascii=False)


def _typed(value: str, schema: dict):
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


GLM45 = dict(
    start="<tool_call>", end="</tool_call>", grouping=(),
    name=re.compile(r"^\s*(?P<name>[^<\n]+?)\s*(?=<arg_key>|\n)"),
    bare_name=re.compile(r"^\s*(?P<name>[^<\n]+?)\s*$"),
    argument=re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>",
                        re.DOTALL),
)  # fmt: skip
QWEN3_CODER = dict(
    start="<tool_call>", end="</tool_call>", grouping=(),
    name=re.compile(r"<function=(?P<name>[^>]+)>"),
    argument=re.compile(r"<parameter=(?P<key>[^>]+)>(?P<value>.*?)</parameter>", re.DOTALL),
    trim_newlines=True,
)  # fmt: skip
MINIMAX_M2 = dict(
    start="<invoke name=", end="</invoke>",
    grouping=("<minimax:tool_call>", "</minimax:tool_call>"),
    name=re.compile(r"^\s*\"(?P<name>[^\"]+)\"\s*>"),
    argument=re.compile(r"<parameter name=\"(?P<key>[^\"]+)\">(?P<value>.*?)</parameter>",
                        re.DOTALL),
)  # fmt: skip
