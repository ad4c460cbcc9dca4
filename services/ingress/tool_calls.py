"""Reading a model's tool calls out of its output text. Pure.

Models here write a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
Hermes style that Qwen, Hermes and the project's own template use; the sim engine writes the
same when a tool choice forces a call). The reply then carries the calls in `tool_calls`, and
the text outside them as its content. A block that is not such JSON stays text: the client sees
what the model wrote, not a guess.

`ToolCallReader` does it incrementally for a stream: text that may be the start of a call is
held back until the call closes (or the stream ends), everything else passes at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as the OpenAI API carries it

    def as_dict(self, index: int | None = None) -> dict[str, object]:
        call: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


def _call_of(block: str, call_id: str) -> ParsedCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ParsedCall(call_id, value["name"], text)


def _held_suffix(text: str) -> int:
    """How many characters at the end of `text` could be the start of OPEN."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallReader:
    """Feed the output's text as it comes; each call returns the content that can be shown now
    and the calls completed by it. `finish()` returns what was held back."""

    id_prefix: str
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""
    _inside: bool = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content: list[str] = []
        completed: list[ParsedCall] = []
        while True:
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _held_suffix(self._buffer)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._inside = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                break
            block = self._buffer[len(OPEN) : end]
            call = _call_of(block, f"{self.id_prefix}{len(self.calls)}")
            if call is None:
                content.append(self._buffer[: end + len(CLOSE)])
            else:
                self.calls.append(call)
                completed.append(call)
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._inside = False
        shown = "".join(content)
        if self.calls and not shown.strip():
            shown = ""  # the whitespace between and after calls is not content
        return shown, completed

    def finish(self) -> str:
        """The text held back: the start of a call that never closed is the model's text."""
        rest, self._buffer, self._inside = self._buffer, "", False
        return "" if self.calls and not rest.strip() else rest


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output: its content (None when only calls) and its calls."""
    reader = ToolCallReader(id_prefix)
    shown, _ = reader.feed(text)
    content = shown + reader.finish()
    if reader.calls:
        return (content.strip() or None), reader.calls
    return content, []
