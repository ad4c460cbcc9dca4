"""Subscriptions whose messages are handed to a callback straight from the connection's read
loop, without nats-py's per-subscription task and queue.

nats-py puts each message of a callback subscription on the subscription's queue, and a task
of its own takes it off and calls the callback: one more wake-up of the event loop per message
before any of our code runs. On the request path that is every hop (architecture §20). Here the
subscription's queue is replaced by an object that calls a plain (synchronous) function at
once; the function must not block (it starts a task, or puts on a queue of its own).

This relies on two private attributes of nats-py's Subscription (`_pending_queue`,
`_pending_size`, as of nats-py 2.x); where they are missing, the ordinary callback path is used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)


class _Inline:
    """Stands in for a subscription's pending queue: `put_nowait` delivers at once."""

    __slots__ = ("_deliver", "_sub")

    def __init__(self, sub: Subscription, deliver: Callable[[Msg], None]):
        self._sub = sub
        self._deliver = deliver

    def put_nowait(self, msg: Msg) -> None:
        # nats-py counted the bytes as pending (its slow-consumer limit); they are handled now.
        self._sub._pending_size -= len(msg.data)
        try:
            self._deliver(msg)
        except Exception as exc:  # never into the connection's read loop
            log.error("inline delivery failed", extra={"subject": msg.subject, "error": repr(exc)})

    async def get(self) -> Msg:
        """nats-py's own subscription task waits here, idle, until the unsubscribe cancels it."""
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable: the future is never resolved")

    # What nats-py asks of the queue elsewhere (pending count, drain, auto-unsubscribe).
    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        return None


async def subscribe_inline(
    nc: NatsClient, subject: str, deliver: Callable[[Msg], None], *, queue: str = ""
) -> Subscription:
    """Subscribe with `deliver` called from the read loop for each message (see module doc)."""

    async def fallback(msg: Msg) -> None:
        deliver(msg)

    sub = await nc.subscribe(subject, queue=queue, cb=fallback)
    if hasattr(sub, "_pending_queue") and hasattr(sub, "_pending_size"):
        # nats-py's own task parks on this queue's `get` until the unsubscribe.
        sub._pending_queue = _Inline(sub, deliver)  # type: ignore[assignment]
    return sub
