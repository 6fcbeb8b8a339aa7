"""The calls one choice makes, and the pieces a stream sends of them.

A call read whole is sent in one piece. A call read as it streams is sent as vLLM sends
it: a first piece with its id and name once the name is known, then its arguments text
in the pieces the model writes them; the pieces of one index concatenate to the call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ToolCallDelta:
    """A piece of call `index`: the first piece has its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class CallLog:
    """The calls of one choice so far, and how much of the open (streaming) one is sent."""

    def __init__(self):
        self.calls: list[ParsedToolCall] = []
        self.streaming = False

    def whole(self, name: str, arguments: str) -> list[ToolCallDelta]:
        call = ParsedToolCall(name, arguments)
        self.calls.append(call)
        return [ToolCallDelta(len(self.calls) - 1, call.id, name, arguments)]

    def stream(self, name: str, arguments: str) -> list[ToolCallDelta]:
        """The open call's pieces not sent yet: `arguments` is what is known of its
        arguments text, which only grows."""
        deltas = []
        if not self.streaming:
            self.calls.append(ParsedToolCall(name, ""))
            self.streaming = True
            deltas.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, name))
        call = self.calls[-1]
        if len(arguments) > len(call.arguments) and arguments.startswith(call.arguments):
            deltas.append(
                ToolCallDelta(len(self.calls) - 1, arguments=arguments[len(call.arguments) :])
            )
            call.arguments = arguments
        return deltas

    def close(self, arguments: str) -> list[ToolCallDelta]:
        """The open call's last pieces; `arguments` is its whole arguments text."""
        deltas = self.stream(self.calls[-1].name, arguments)
        self.streaming = False
        return deltas


def merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One piece per call: the pieces of one read that belong to one call, joined."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index:
            out[-1].arguments += delta.arguments
        else:
            out.append(delta)
    return out


class ToolCallReader:
    """What every format's reader keeps: its calls so far and the text it has not read
    yet. `read(text, final)` takes the next piece of a choice's text and returns the
    content and the call pieces it completes (with final, everything left); `markers`
    are the format's tags, which decoding must keep."""

    markers: tuple[str, ...] = ()

    def __init__(self):
        self.log = CallLog()
        self.pending = ""

    @property
    def calls(self) -> list[ParsedToolCall]:
        return self.log.calls

    def read(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError
