"""The ingress's HTTP helpers: OpenAI-shaped error responses, SSE framing and the optional
`x-request-id` and `x-ripple-*` headers."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse

from schemas.events import PriorityClass, WorkflowRef
from services.ingress.openai_api import error_body
from services.ingress.prepare import InvalidRequest

PRIORITIES: tuple[PriorityClass, ...] = ("critical", "standard", "sheddable")


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after_s: float | None = None,
) -> JSONResponse:
    type_ = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
    return JSONResponse(
        error_body(message, type_=type_, param=param, code=code),
        status_code=status,
        headers=headers,
    )


def client_request_id_of(request: Request) -> str | None:
    """The client's own `x-request-id`, echoed and recorded (printable ASCII, at most 128)."""
    raw = request.headers.get("x-request-id")
    if raw is None or not 0 < len(raw) <= 128 or not raw.isascii() or not raw.isprintable():
        return None
    return raw


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def ripple_headers(request: Request) -> tuple[PriorityClass | None, int, int | None, WorkflowRef | None]:
    """The optional `x-ripple-*` headers; a malformed one is a 400 naming it. The priority level's
    range is admission's to check (its config); no priority asked is None (the tenant's class)."""
    headers = request.headers
    priority = headers.get("x-ripple-priority")
    if priority is not None and priority not in PRIORITIES:
        raise InvalidRequest(
            f"x-ripple-priority must be one of {', '.join(PRIORITIES)}", param="x-ripple-priority"
        )

    def integer(name: str) -> int | None:
        raw = headers.get(name)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise InvalidRequest(f"{name} must be an integer", param=name) from None
        if value < 1 or value > 10**9:
            raise InvalidRequest(f"{name} must be between 1 and 1000000000", param=name)
        return value

    deadline_ms = integer("x-ripple-deadline-ms")
    raw_level = headers.get("x-ripple-priority-level", "0")
    try:
        priority_level = int(raw_level)
    except ValueError:
        raise InvalidRequest(
            "x-ripple-priority-level must be an integer", param="x-ripple-priority-level"
        ) from None
    workflow = None
    workflow_id = headers.get("x-ripple-workflow-id")
    step = integer("x-ripple-workflow-step")
    steps = integer("x-ripple-workflow-steps")
    if workflow_id is None and (step is not None or steps is not None):
        name = "x-ripple-workflow-step" if step is not None else "x-ripple-workflow-steps"
        raise InvalidRequest(f"{name} needs x-ripple-workflow-id", param=name)
    if workflow_id is not None:
        try:
            workflow = msgspec.convert(
                {"workflow_id": workflow_id, "step": step or 1, "steps": steps},
                WorkflowRef,
            )
        except msgspec.ValidationError:
            raise InvalidRequest(
                "x-ripple-workflow-id must be 1-128 characters of [A-Za-z0-9_-]",
                param="x-ripple-workflow-id",
            ) from None
    return priority, priority_level, deadline_ms, workflow  # type: ignore[return-value]


def field_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.messages[0].role`"; the field is what follows `$.`.
    text = str(exc)
    marker = "at `$."
    if marker in text:
        return text.split(marker, 1)[1].rstrip("`")
    return None
