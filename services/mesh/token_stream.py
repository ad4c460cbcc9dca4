"""Reading one request's token stream: in sequence order, without duplicates, with timeouts.

Workers publish `TokenChunk`s (and a final `StreamFinished` or `StreamFailed`) to
``rmesh.tokens.<tenant>.<request_id>`` with a per-request sequence number. Both the HTTP ingress
and `MeshClient` read them through this class, subscribed before the request is published.
A chunk that arrives ahead of a missing one is held back; if the gap does not fill quickly the
missing chunks are read back from the TOKENS stream, which keeps every chunk for a while.

A reader whose connection moved to another node (a node lost) may have missed events with
nothing after them to show a gap, the final one included: after a reconnect it reads back once
from its next sequence number. Services read back through a JetStream consumer; a tenant's
client, which has no JetStream API, passes `read_back` to ask ingress to publish the events
again on the subscribed subject (`ReplayTokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

from schemas.events import StreamFailed, StreamFinished, TokenChunk, TokenEvent
from schemas.subjects import TOKENS
from services.mesh.inline_sub import subscribe_inline

log = logging.getLogger(__name__)

GAP_WAIT_S = 0.5
# A gap still open is read back again this often, until the idle timeout gives up on it.
READ_BACK_EVERY_S = 2.0

# Given the next sequence number wanted: the events it could read back at once (they are held
# and yielded in order), or none when they will arrive on the subscription.
ReadBack = Callable[[int], Awaitable[list[TokenEvent]]]
_decoder: msgspec.json.Decoder[TokenEvent] = msgspec.json.Decoder(TokenEvent)  # type: ignore[arg-type]


class StreamTimeout(TimeoutError):
    pass


class TokenStream:
    def __init__(
        self,
        nc: NatsClient,
        subject: str,
        *,
        first_event_timeout_s: float,
        idle_timeout_s: float,
        read_back: ReadBack | None = None,
    ):
        self._nc = nc
        self.subject = subject
        self._first_timeout = first_event_timeout_s
        self._idle_timeout = idle_timeout_s
        self._read_back_from: ReadBack = read_back or self._read_back
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._reconnects = self._reconnect_count()
        self.next_seq = 0
        self.malformed = 0
        self.read_backs = 0

    async def open(self) -> TokenStream:
        # No flush needed: the server handles one connection's commands in order, so this
        # subscription is in place before the request published next on the same connection,
        # and so before any token that request leads to. Inline (inline_sub.py): the reader
        # waiting in `events` wakes one loop turn sooner.
        self._sub = await subscribe_inline(self._nc, self.subject, self._queue.put_nowait)
        return self

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def __aenter__(self) -> TokenStream:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _decode(self, msg: Msg) -> TokenEvent | None:
        try:
            return _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed += 1
            return None

    def _reconnect_count(self) -> int:
        return int(self._nc.stats.get("reconnects", 0))

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield events in order; ends after the final event; raises StreamTimeout when silent."""
        held: dict[int, TokenEvent] = {}
        # When the current wait began (the idle timeout runs from here), and the next read-back.
        waiting_since = time.monotonic()
        read_back_at: float | None = None
        while True:
            if self.next_seq in held:
                event = held.pop(self.next_seq)
            else:
                now = time.monotonic()
                timeout = self._first_timeout if self.next_seq == 0 else self._idle_timeout
                if read_back_at is None and (held or self._reconnect_count() != self._reconnects):
                    # A gap, or a reconnect that may have dropped events: read back if it lasts.
                    read_back_at = now + GAP_WAIT_S
                give_up_at = waiting_since + timeout
                wake_at = min(give_up_at, read_back_at) if read_back_at is not None else give_up_at
                try:
                    if self._queue.empty():
                        # One timer (wait_for would add a task per wait: this is every token's path).
                        async with asyncio.timeout(max(0.0, wake_at - now)):
                            msg = await self._queue.get()
                    else:
                        msg = self._queue.get_nowait()
                except TimeoutError:
                    now = time.monotonic()
                    if now >= give_up_at:
                        missing = f"token {self.next_seq} of {self.subject} is missing"
                        silent = f"no token for {self.subject} within {timeout:.0f}s"
                        raise StreamTimeout(missing if held else silent) from None
                    self._reconnects = self._reconnect_count()
                    self.read_backs += 1
                    failed = False
                    try:
                        recovered = await self._read_back_from(self.next_seq)
                    except (nats.errors.Error, TimeoutError) as exc:
                        # The stream may be electing a leader: try again a little later.
                        log.info("read-back failed", extra={"subject": self.subject, "error": repr(exc)})
                        recovered, failed = [], True
                    for item in recovered:
                        if item.seq >= self.next_seq:
                            held.setdefault(item.seq, item)
                    # Again while a gap stays open (or the read-back failed), until the timeout.
                    read_back_at = time.monotonic() + READ_BACK_EVERY_S if held or failed else None
                    continue
                decoded = self._decode(msg)
                if decoded is None or decoded.seq < self.next_seq:
                    continue  # malformed, or a duplicate of one already yielded
                if decoded.seq > self.next_seq:
                    held.setdefault(decoded.seq, decoded)
                    continue
                event = decoded
            self.next_seq += 1
            waiting_since, read_back_at = time.monotonic(), None
            yield event
            if isinstance(event, StreamFinished | StreamFailed):
                return

    async def _read_back(self, from_seq: int) -> list[TokenEvent]:
        """Every event of this request kept on the TOKENS stream, to fill a gap (a service's
        reader: it needs the JetStream API)."""
        events: list[TokenEvent] = []
        for msg in await stored_messages(self._nc, self.subject):
            decoded = self._decode(msg)
            if decoded is not None:
                events.append(decoded)
        return events


async def stored_messages(nc: NatsClient, subject: str, *, timeout_s: float = 5.0) -> list[Msg]:
    """Every message of one request's token subject the TOKENS stream holds, in stream order, up
    to the last one stored when called: an ordered consumer (the JetStream API, which services
    have and tenants do not) bounded by that message and by `timeout_s` (TimeoutError past it)."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        last = await js.get_last_msg(TOKENS.name, subject)
    except NotFoundError:
        return []
    messages: list[Msg] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    sub = await js.subscribe(subject, stream=TOKENS.name, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=max(0.01, deadline - loop.time()))
            messages.append(msg)
            if msg.metadata.sequence.stream >= (last.seq or 0):
                return messages
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def stored_events(nc: NatsClient, subject: str, *, timeout_s: float = 5.0) -> list[TokenEvent]:
    """`stored_messages`, decoded; a malformed message is skipped."""
    events: list[TokenEvent] = []
    for msg in await stored_messages(nc, subject, timeout_s=timeout_s):
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            events.append(_decoder.decode(msg.data))
    return events


def is_final(event: TokenEvent) -> bool:
    return not isinstance(event, TokenChunk)
