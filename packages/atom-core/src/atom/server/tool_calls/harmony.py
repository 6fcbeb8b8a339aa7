"""GPT-OSS's harmony format (`openai`): the output is a run of messages, each a header and a
body, `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>commentary
to=functions.f <|constrain|>json<|message|>{...}<|call|>`.

A message whose header names a recipient `to=functions.f` is a call, its body the arguments
JSON; the final channel and commentary without a recipient (a preamble) are content; the
analysis channel is the model's reasoning, which is not content. `<|call|>` and `<|return|>`
stop the output, so the last message usually ends with the output itself.
"""

from __future__ import annotations

import json
import re

from atom.server.tool_calls.calls import ToolCallDelta, ToolCallReader, merged
from atom.server.tool_calls.reader import safe_end

MESSAGE = "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyReader(ToolCallReader):
    markers = (MESSAGE, "<|channel|>", "<|start|>", *MESSAGE_ENDS)

    def __init__(self):
        super().__init__()
        self.kind: str | None = None  # of the open message: content, reasoning, or a call
        self.call_name = ""
        self.sent = 0  # of the open message's body, for content

    def read(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.pending += text
        content, deltas = [], []
        while True:
            if self.kind is None:
                start = self.pending.find(MESSAGE)
                if start < 0:
                    if final:  # not harmony at all: the text as written
                        content.append(self.pending if not self.log.calls else "")
                        self.pending = ""
                    break
                self._open(self.pending[:start])
                self.pending = self.pending[start + len(MESSAGE) :]
            ends = [i for i in (self.pending.find(end) for end in MESSAGE_ENDS) if i >= 0]
            if ends or final:
                end = min(ends) if ends else len(self.pending)
                self._body(self.pending[:end], True, content, deltas)
                rest = self.pending[end:]
                self.pending = rest[next((len(e) for e in MESSAGE_ENDS if rest.startswith(e)), 0) :]
                self.kind = None
                if not ends:
                    break
                continue
            self._body(self.pending[: safe_end(self.pending, MESSAGE_ENDS)], False, content, deltas)
            break
        return "".join(content), merged(deltas)

    def _open(self, header: str) -> None:
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        if recipient is not None:
            self.kind, self.call_name = "call", recipient[1]
        elif channel is None or channel[1] in ("final", "commentary"):
            self.kind = "content"
        else:
            self.kind = "reasoning"
        self.sent = 0

    def _body(self, body: str, whole: bool, content: list[str], deltas: list) -> None:
        if self.kind == "content":
            content.append(body[self.sent :])
            self.sent = len(body)
        elif self.kind == "call" and whole and not self.log.streaming:
            try:
                arguments = json.dumps(json.loads(body), ensure_ascii=False)
            except json.JSONDecodeError:
                arguments = body.strip()
            deltas += self.log.whole(self.call_name, arguments)
        elif self.kind == "call" and whole:
            deltas += self.log.close(body.strip())
        elif self.kind == "call" and body.strip():
            deltas += self.log.stream(self.call_name, body.strip())
