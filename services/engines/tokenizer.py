"""A small reversible tokenizer for the sim engine: common English words plus a byte fallback.

Real engines bring their model's own tokenizer; the sim engine needs one that needs no download,
round-trips any text exactly (ids 0-255 are raw UTF-8 bytes), and produces readable output.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from schemas.events import ChatMessage

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

    def render_chat(self, messages: Sequence[ChatMessage]) -> str: ...


def role_tagged_chat(messages: Sequence[ChatMessage]) -> str:
    """The project's chat template: role-tagged turns, ending with the assistant's turn."""
    turns = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages)
    return turns + "<|assistant|>\n"


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

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        return role_tagged_chat(messages)


class HfTokenizer:
    """A Hugging Face tokenizer from a local model directory (transformers, no download)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if getattr(self._tokenizer, "chat_template", None):
            turns = [{"role": m.role, "content": m.content} for m in messages]
            return str(self._tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        return role_tagged_chat(messages)


def _has_tokenizer_files(path: str) -> bool:
    folder = Path(path)
    return any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


@functools.lru_cache(maxsize=16)
def tokenizer_for(path: str | None) -> Tokenizer:
    """The tokenizer of a model: its own when its directory has one, else the word tokenizer."""
    if path is not None and _has_tokenizer_files(path):
        return HfTokenizer(path)
    return SimpleTokenizer()
