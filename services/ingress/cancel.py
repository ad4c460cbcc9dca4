"""Cancellation at the front door: an HTTP client that goes away, or a NATS client's
`CancelRequest`, becomes a `RequestCancelled` lifecycle event; the workers holding the request
stop it and free its KV (services/engines/lifecycle.py), the ledger closes it.

An HTTP client's disconnect is seen by waiting on the ASGI ``receive`` channel, which yields
``http.disconnect`` once the connection is gone (the body has been read by then): while the
ingress waits for the first token, and while it collects a non-streamed answer. A streamed (SSE)
answer is cut by Starlette itself when the client goes, and the stream's generator cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Literal, TypeVar

from starlette.requests import Request

from schemas.events import RequestCancelled, WorkflowRef, derived_event_id

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled and
    `ClientGone` raised."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ClientGone()
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()


def cancelled(
    request_id: str,
    tenant: str,
    reason: Literal["client_disconnected", "client_cancelled"],
    *,
    workflow: WorkflowRef | None = None,
    deadline_at: float | None = None,
    source_event_id: str | None = None,
) -> RequestCancelled:
    """The lifecycle event for a request its client gave up on; one id per request (or per
    cancellation message), so a cancellation seen twice is recorded once."""
    return RequestCancelled(
        event_id=derived_event_id(source_event_id or request_id, "cancelled"),
        occurred_at=time.time(),
        request_id=request_id,
        tenant=tenant,
        reason=reason,
        workflow_id=workflow.workflow_id if workflow else None,
        workflow_step=workflow.step if workflow else None,
        workflow_steps=workflow.steps if workflow else None,
        deadline_at=deadline_at,
    )
