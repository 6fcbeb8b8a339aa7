"""Reading calls out of a choice's text, fed piece by piece as it streams (or whole).

A format marks each call with a start and an end marker (`<tool_call>` … `</tool_call>`);
markers that only group calls (DeepSeek's `<｜tool▁calls▁begin｜>`) are dropped from the
content. Text that may be the start of a marker is held back until it is known. A call's
body is given to the format: whole, once its end marker came, or as it grows, so that the
name and arguments stream out before the call ends. A whole block whose body is not a call
stays content; a call cut short (max_tokens) that has begun to stream ends where it was cut.
"""

from __future__ import annotations

from typing import Protocol

from atom.server.tool_calls.calls import ToolCallDelta, ToolCallReader, merged


class BlockFormat(Protocol):
    start: str  # marks the start of one call
    end: str  # and its end
    grouping: tuple[str, ...]  # markers around a group of calls: dropped from the content

    def whole(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of a whole block's body; None when it is not a call."""

    def partial(self, body: str) -> tuple[str, str] | None:
        """(name, the arguments text known so far) of a growing body, once its name is
        known. The text known so far is a prefix of `finish`'s."""

    def finish(self, body: str) -> str:
        """The whole arguments text of a call that began to stream."""


def safe_end(text: str, markers: tuple[str, ...]) -> int:
    """Where the text that cannot be the start of one of `markers` ends."""
    for keep in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-keep:]) for marker in markers):
            return len(text) - keep
    return len(text)


class MarkedCallReader(ToolCallReader):
    def __init__(self, format: BlockFormat):
        super().__init__()
        self.format = format
        self.in_block = False
        self.markers = (format.start, format.end, *format.grouping)

    def read(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """The content and call pieces `text` completes; with final, everything left."""
        self.pending += text
        content, deltas = [], []
        while True:
            if self.in_block:
                if not self._read_block(final, content, deltas):
                    break
                continue
            start = self.pending.find(self.format.start)
            cut = start if start >= 0 else len(self.pending)
            if start < 0 and not final:
                cut = safe_end(self.pending, (self.format.start, *self.format.grouping))
            content.append(self._content(self.pending[:cut]))
            if start < 0:
                self.pending = self.pending[cut:]
                break
            self.pending = self.pending[start + len(self.format.start) :]
            self.in_block = True
        return "".join(content), merged(deltas)

    def _read_block(self, final: bool, content: list[str], deltas: list) -> bool:
        """Reads the open block; True when it ended and reading goes on after it."""
        fmt, end = self.format, self.pending.find(self.format.end)
        if end < 0 and not final:
            body = self.pending[: safe_end(self.pending, (fmt.end,))]
            known = fmt.partial(body)
            if known is not None:
                deltas += self.log.stream(*known)
            return False
        body = self.pending if end < 0 else self.pending[:end]
        if self.log.streaming:
            deltas += self.log.close(fmt.finish(body))
        elif end >= 0 and (call := fmt.whole(body)) is not None:
            deltas += self.log.whole(*call)
        else:
            closing = fmt.end if end >= 0 else ""
            content.append(self._content(fmt.start + body + closing))
        self.pending = "" if end < 0 else self.pending[end + len(fmt.end) :]
        self.in_block = False
        return end >= 0

    def _content(self, text: str) -> str:
        for marker in self.format.grouping:
            text = text.replace(marker, "")
        # Between and after calls, models write newlines: no content worth a message.
        return "" if self.log.calls and not text.strip() else text
