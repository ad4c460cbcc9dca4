"""A small reversible tokenizer for the sim engine: common English words plus a byte fallback.

Real engines bring their model's own tokenizer; the sim engine needs one that needs no download,
round-trips any text exactly (ids 0-255 are raw UTF-8 bytes), and produces readable output.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from schemas.events import ChatMessage, FunctionCall, RefusalPart, TextPart, ToolSpec

_WORDS = """
the of and to in is that for it as with was on be by this are from or at an have not which
but all can more one has their there will its also when other into may time new some these
two would any than only first use about so over such like most many then out made after where
model token cache request worker batch prefill decode latency cost router admission queue fleet
node stream trace event tenant budget deadline workflow step agent task answer question data
system service value result memory compute network server client message signal state plan
scale pool price hour second fast slow high low good best small large each every what how why
who because while before during between through without within under again further here
never always often still just very well also even back much both down up same different own
""".split()

BYTE_TOKENS = 256
_PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> str:
        """The prompt for `messages`, ending with the assistant's turn; raises ChatTemplateError
        for what the model's template cannot render (tools, for a template without them)."""
        ...


class ChatTemplateError(ValueError):
    """What a model's chat template cannot render; `param` names the request's field."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


def message_text(message: ChatMessage) -> str:
    """A message's text: its content string, or its text (and refusal) parts joined. Parts of
    other kinds are refused before rendering (ingress's prepare)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        part.text if isinstance(part, TextPart) else part.refusal
        for part in content
        if isinstance(part, TextPart | RefusalPart)
    )


def call_arguments(call: FunctionCall) -> Any:
    """A call's arguments as a JSON value when they parse (what templates and models write),
    else the text as the client sent it."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def written_tool_call(call: FunctionCall) -> str:
    """A tool call as a model writes it in the project's format (Hermes-style), which the
    ingress parses back out of the output (services/ingress/tool_calls.py)."""
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": call_arguments(call)}) + "</tool_call>"


def _calls_of(message: ChatMessage) -> list[FunctionCall]:
    calls = [call.function for call in message.tool_calls or ()]
    if message.function_call is not None:
        calls.append(message.function_call)
    return calls


def role_tagged_chat(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> str:
    """The project's chat template: the tools' specs first, then role-tagged turns, ending with
    the assistant's turn. An assistant turn holds its text and its tool calls as the model wrote
    them; a tool's (or legacy function's) result is a `tool` turn. A conversation's next step
    renders its previous prompt unchanged, then the new turns: the prefix the caches share."""
    parts = []
    if tools:
        specs = [tool_function_dict(tool) for tool in tools]
        parts.append("<|tools|>\n" + json.dumps(specs) + "\n")
    for m in messages:
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        body = message_text(m) + "".join(written_tool_call(call) for call in _calls_of(m))
        parts.append(f"<|{role}|>\n{body}\n")
    return "".join(parts) + "<|assistant|>\n"


def tool_function_dict(tool: ToolSpec) -> dict[str, Any]:
    """A tool's function as templates show it: its name, and what of description and
    parameters it has."""
    function = tool.function
    spec: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        spec["description"] = function.description
    if function.parameters is not None:
        spec["parameters"] = function.parameters
    return spec


class SimpleTokenizer:
    def __init__(self) -> None:
        pieces: list[str] = []
        for word in _WORDS:
            pieces.extend((word, " " + word, " " + word.capitalize()))
        self._id_of = {piece: BYTE_TOKENS + i for i, piece in enumerate(dict.fromkeys(pieces))}
        self._piece_of = {i: piece for piece, i in self._id_of.items()}
        # Word ids that start with a space: what the sim engine generates, so output reads as words.
        self.word_ids = [i for piece, i in self._id_of.items() if piece.startswith(" ")]
        self.vocab_size = BYTE_TOKENS + len(self._id_of)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for match in _PIECE.finditer(text):
            piece = match.group()
            known = self._id_of.get(piece)
            if known is not None:
                ids.append(known)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for token in ids:
            if 0 <= token < BYTE_TOKENS:
                out.append(token)
            else:
                out.extend(self._piece_of.get(token, "").encode("utf-8"))
        return out.decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> str:
        return role_tagged_chat(messages, tools)


class HfTokenizer:
    """A Hugging Face tokenizer from a local model directory (transformers, no download)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> str:
        template = getattr(self._tokenizer, "chat_template", None)
        if not template:
            return role_tagged_chat(messages, tools)
        if tools and "tools" not in str(template):
            raise ChatTemplateError("this model's chat template does not render tools", param="tools")
        turns = [_hf_turn(m) for m in messages]
        rendered = self._tokenizer.apply_chat_template(
            turns,
            tools=[{"type": "function", "function": tool_function_dict(tool)} for tool in tools] or None,
            add_generation_prompt=True,
            tokenize=False,
        )
        return str(rendered)


def _hf_turn(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates read it: text content, tool calls with their
    arguments as objects, the tool's call id and name."""
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    turn: dict[str, Any] = {"role": role, "content": message_text(message)}
    calls = _calls_of(message)
    if calls:
        ids = [call.id for call in message.tool_calls or ()]
        turn["tool_calls"] = [
            {
                "id": ids[i] if i < len(ids) else f"call_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": call_arguments(call)},
            }
            for i, call in enumerate(calls)
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        turn["name"] = message.name
    return turn


def _has_tokenizer_files(path: str) -> bool:
    folder = Path(path)
    return any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


@functools.lru_cache(maxsize=16)
def tokenizer_for(path: str | None) -> Tokenizer:
    """The tokenizer of a model: its own when its directory has one, else the word tokenizer."""
    if path is not None and _has_tokenizer_files(path):
        return HfTokenizer(path)
    return SimpleTokenizer()
