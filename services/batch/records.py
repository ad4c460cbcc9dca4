"""The Batch API's records and line formats, pure (no I/O): what is stored (files, batches, each
line's result), how an input line is read, and how a result is written in OpenAI's batch output
shape (``id``, ``custom_id``, ``response{status_code, request_id, body}``, ``error``).

Used by ingress (the HTTP routes, `services/ingress/batch_api.py`) and by the batch runner
(`services/batch/service.py`); the store is `services/batch/store.py`.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec

from schemas.events import ChatMessage, ResponseFormat, ToolChoice, ToolSpec
from services.ingress.openai_api import ChatCompletionBody, CompletionBody, error_body

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# A batch in one of these is done: nothing more runs for it.
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
# The runner works on a batch in one of these.
ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS: dict[str, float] = {"24h": 24 * 3600.0}
FilePurpose = Literal["batch", "batch_output"]
# OpenAI's limits on one batch's input.
MAX_LINES = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024


def new_id(prefix: str) -> str:
    """A file or batch id (``file-…``, ``batch_…``): also a NATS KV key and a request-id prefix."""
    return f"{prefix}{secrets.token_hex(12)}"


class FileRecord(msgspec.Struct, kw_only=True):
    """A stored file's metadata (its bytes are an object of the same name)."""

    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class LineError(msgspec.Struct, kw_only=True):
    """A line the runner could not run (the batch's `errors.data`, OpenAI's BatchError)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchRecord(msgspec.Struct, kw_only=True):
    """One batch, as stored (the BATCHES bucket, keyed by id) and as `GET /v1/batches/{id}` says."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    # Malformed lines (with their line numbers) and why a batch failed.
    errors: list[LineError] = []

    def as_openai(self) -> dict[str, Any]:
        body = msgspec.to_builtins(self)
        body.pop("tenant")
        body["object"] = "batch"
        body["errors"] = (
            {"object": "list", "data": [msgspec.to_builtins(e) for e in self.errors]} if self.errors else None
        )
        return dict(body)


class LineResult(msgspec.Struct, kw_only=True):
    """What became of one input line: its output line (OpenAI's batch output shape), and whether
    it goes to the output file (a 2xx response) or the error file. Stored once per line (the
    BATCH_LINES bucket, key ``<batch_id>.<line>``), so a resumed batch skips it."""

    line: int
    ok: bool
    output: dict[str, Any]


class LineRequest(msgspec.Struct, kw_only=True, frozen=True):
    """A valid input line: what the runner submits (MeshClient's parameters)."""

    line: int
    custom_id: str
    api: Literal["chat", "completion"]
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: int | None = None


class _InputLine(msgspec.Struct, kw_only=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class MalformedLine(Exception):
    def __init__(self, message: str, custom_id: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.custom_id = custom_id
        self.param = param


def parse_line(line_no: int, raw: bytes, endpoint: str) -> LineRequest:
    """One input line (numbered from 1) as a request, or `MalformedLine` saying what is wrong."""
    try:
        item = msgspec.json.decode(raw, type=_InputLine)
    except msgspec.ValidationError as exc:
        raise MalformedLine(f"line {line_no}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MalformedLine(f"line {line_no}: not valid JSON ({exc})") from None
    if item.method.upper() != "POST":
        raise MalformedLine(f"line {line_no}: method must be POST", item.custom_id, "method")
    if item.url != endpoint:
        raise MalformedLine(
            f"line {line_no}: url {item.url!r} is not the batch's endpoint {endpoint!r}",
            item.custom_id,
            "url",
        )
    try:
        if endpoint == "/v1/chat/completions":
            chat = msgspec.json.decode(item.body, type=ChatCompletionBody)
            body: ChatCompletionBody | CompletionBody = chat
            max_tokens = next(
                (n for n in (chat.max_completion_tokens, chat.max_tokens) if n is not None), 256
            )
            request = LineRequest(
                line=line_no,
                custom_id=item.custom_id,
                api="chat",
                model=chat.model,
                messages=chat.messages,
                max_tokens=max_tokens,
                temperature=chat.temperature,
                tools=chat.tools,
                tool_choice=chat.tool_choice,
                response_format=chat.response_format,
                logprobs=(chat.top_logprobs or 0) if chat.logprobs else None,
            )
        else:
            completion = msgspec.json.decode(item.body, type=CompletionBody)
            body = completion
            prompt = completion.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise MalformedLine(
                        f"line {line_no}: prompt must be a string or a list of one string",
                        item.custom_id,
                        "body.prompt",
                    )
                prompt = prompt[0]
            request = LineRequest(
                line=line_no,
                custom_id=item.custom_id,
                api="completion",
                model=completion.model,
                prompt=prompt,
                max_tokens=completion.max_tokens,
                temperature=completion.temperature,
                logprobs=completion.logprobs,
            )
    except msgspec.ValidationError as exc:
        raise MalformedLine(f"line {line_no}: invalid body: {exc}", item.custom_id, "body") from None
    except msgspec.DecodeError as exc:
        raise MalformedLine(f"line {line_no}: the body is not valid JSON ({exc})", item.custom_id) from None
    refused = body.refused_parameter()
    if refused is not None:
        raise MalformedLine(f"line {line_no}: {refused} is not supported here", item.custom_id, refused)
    if body.stream:
        raise MalformedLine(f"line {line_no}: a batch line cannot stream", item.custom_id, "body.stream")
    if body.n != 1:
        raise MalformedLine(f"line {line_no}: a batch line takes n = 1", item.custom_id, "body.n")
    return request


def split_lines(content: bytes) -> list[tuple[int, bytes]]:
    """The input file's non-blank lines, numbered from 1 as they stand in the file."""
    return [(i, raw) for i, raw in enumerate(content.split(b"\n"), start=1) if raw.strip()]


def output_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def success_line(
    batch_id: str, line: int, custom_id: str, request_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": output_id(batch_id, line),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def failure_line(
    batch_id: str,
    line: int,
    custom_id: str | None,
    *,
    code: str,
    message: str,
    status_code: int | None = None,
    request_id: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """An error-file line: with the mesh's HTTP answer when the request was refused or failed
    (`status_code`), without one when the line never became a request (malformed, expired,
    cancelled). The message names the line."""
    response = None
    if status_code is not None:
        type_ = "invalid_request_error" if status_code < 500 else "server_error"
        response = {
            "status_code": status_code,
            "request_id": request_id,
            "body": error_body(message, type_=type_, param=param, code=code),
        }
    return {
        "id": output_id(batch_id, line),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message, "line": line},
    }


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(msgspec.json.encode(row) + b"\n" for row in rows)
