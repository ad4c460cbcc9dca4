"""The OpenAI-compatible request and response bodies, as msgspec Structs.

Request bodies are decoded strictly for the fields we use (a wrong type is a 400 naming the field)
and ignore fields we do not use, as OpenAI clients send many optional ones.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec

from schemas.events import ChatMessage, ResponseFormat, TokenLogprob, ToolChoice, ToolSpec, Usage
from services.ingress.tool_calls import ParsedCall, ToolCallReader, parse_tool_calls


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


# Sampling parameters no engine here honours: refused (a 400 naming the parameter) unless left
# at the value that changes nothing, so a client never gets output it did not ask for.
UNSUPPORTED_UNLESS = {
    "top_p": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


# Each choice is a sequence the mesh admits, places and bills; a bound keeps one request from
# becoming a burst (vLLM's own is its max_num_seqs).
MAX_CHOICES = 16


class _Common(msgspec.Struct, kw_only=True):
    model: str
    temperature: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices: n sequences, the first prefilled, the others placed on its cached prompt.
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted, and what they ask holds here: engines are deterministic per request (seed), and
    # any number of tool calls is read out of the output (parallel_tool_calls).
    seed: int | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None

    def refused_parameter(self) -> str | None:
        """The first parameter set to something no engine here does, if any."""
        for name, neutral in UNSUPPORTED_UNLESS.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                return name
        if self.stop:
            return "stop"
        if self.logit_bias:
            return "logit_bias"
        return None


class ChatCompletionBody(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[str]
    max_tokens: int = 16
    # The legacy API's: how many alternatives besides each token (0-5 at OpenAI; up to 20 here).
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    suffix: str | None = None

    def refused_parameter(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        return super().refused_parameter()


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
    """Builds chat or text-completion response objects for one choice (`index`) of a request:
    its text, the tool calls read out of it (`tool_calls`), its log-probabilities
    (`top_logprobs` alternatives, None for none), chunk by chunk for a stream or whole."""

    def __init__(
        self,
        api: Literal["chat", "completion"],
        request_id: str,
        model: str,
        *,
        index: int = 0,
        tool_calls: bool = False,
        top_logprobs: int | None = None,
    ):
        self.api = api
        self.id = ("chatcmpl-" if api == "chat" else "cmpl-") + request_id
        self.model = model
        self.index = index
        self.created = int(time.time())
        call_ids = f"call_{request_id[:24]}_{index}_" if index else f"call_{request_id[:24]}_"
        self.reader = ToolCallReader(call_ids) if tool_calls and api == "chat" else None
        self.top_logprobs = top_logprobs
        self._first = True
        self._text_offset = 0

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ------------------------------------------------------------ log-probabilities

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        k = self.top_logprobs
        if self.api == "chat":
            return {
                "content": [
                    {
                        "token": e.token,
                        "logprob": e.logprob,
                        "bytes": list(e.token.encode()),
                        "top_logprobs": [
                            {"token": a.token, "logprob": a.logprob, "bytes": list(a.token.encode())}
                            for a in e.top[:k]
                        ],
                    }
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{a.token: a.logprob for a in e.top[:k]} for e in entries],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------ a stream

    def _chunk(
        self,
        text: str,
        finish_reason: str | None,
        *,
        logprobs: dict[str, Any] | None = None,
        calls: list[tuple[int, ParsedCall]] | None = None,
    ) -> dict[str, Any]:
        if self.api == "chat":
            delta: dict[str, Any] = {"content": text} if text or not calls else {}
            if self._first:
                delta["role"] = "assistant"
            if calls:
                delta["tool_calls"] = [call.as_dict(index) for index, call in calls]
            self._first = False
            choice = {
                "index": self.index,
                "delta": delta,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
            return self._envelope("chat.completion.chunk", [choice])
        self._first = False
        choice = {"index": self.index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._envelope("text_completion", [choice])

    def chunks(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        """The chunks to send for a piece of output (none while a tool call is being written)."""
        calls: list[ParsedCall] = []
        if self.reader is not None:
            text, calls = self.reader.feed(text)
        lp = self._logprobs(logprobs) if logprobs else None
        out = []
        if text or lp is not None or (self._first and not calls):
            out.append(self._chunk(text, None, logprobs=lp))
        if calls:
            first_index = len(self.reader.calls) - len(calls) if self.reader else 0
            out.append(self._chunk("", None, calls=list(enumerate(calls, first_index))))
        return out

    def final_chunks(self, finish_reason: str) -> list[dict[str, Any]]:
        """What was held back, then the chunk with the finish reason."""
        out = []
        rest = self.reader.finish() if self.reader is not None else ""
        if rest:
            out.append(self._chunk(rest, None))
        out.append(self._chunk("", self.finish_reason(finish_reason)))
        return out

    def finish_reason(self, engine_reason: str) -> str:
        if self.reader is not None and self.reader.calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        object_ = "chat.completion.chunk" if self.api == "chat" else "text_completion"
        return {**self._envelope(object_, []), "usage": usage_dict(usage)}

    # ------------------------------------------------------------ whole

    def choice(self, text: str, logprobs: list[TokenLogprob], finish_reason: str) -> dict[str, Any]:
        """The whole choice, as a non-streamed response lists it."""
        lp = self._logprobs(logprobs)
        if self.api != "chat":
            return {"index": self.index, "text": text, "finish_reason": finish_reason, "logprobs": lp}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reader is not None:
            content, calls = parse_tool_calls(text, self.reader.id_prefix)
            if calls:
                message["content"] = content
                message["tool_calls"] = [call.as_dict() for call in calls]
                self.reader.calls = calls
        return {
            "index": self.index,
            "message": message,
            "finish_reason": self.finish_reason(finish_reason),
            "logprobs": lp,
        }

    def response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion" if self.api == "chat" else "text_completion", choices)
        body["usage"] = usage_dict(usage)
        return body


def choices_usage(usages: list[Usage]) -> Usage:
    """A request's usage over its choices: the prompt once (it is one prompt, as OpenAI counts
    it), cached as the first choice found it, every choice's output."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
    )
