"""The OpenAI-compatible request and response bodies, as msgspec Structs.

Request bodies are decoded strictly for the fields we use (a wrong type is a 400 naming the field)
and ignore fields we do not use, as OpenAI clients send many optional ones.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from schemas.events import ChatMessage, Usage


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionBody(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


class CompletionBody(msgspec.Struct, kw_only=True):
    model: str
    prompt: str | list[str]
    max_tokens: int = 16
    temperature: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ResponseShape:
    """Builds chat or text-completion response objects for one request."""

    def __init__(self, api: Literal["chat", "completion"], request_id: str, model: str):
        self.api = api
        self.id = ("chatcmpl-" if api == "chat" else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, text: str, finish_reason: str | None, *, first: bool) -> dict[str, Any]:
        if self.api == "chat":
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        object_ = "chat.completion.chunk" if self.api == "chat" else "text_completion"
        return {**self._envelope(object_, []), "usage": usage_dict(usage)}

    def complete(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        if self.api == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_dict(usage)
        return body
