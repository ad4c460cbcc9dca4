"""Reading one request's token stream: in sequence order, without duplicates, with timeouts.

Workers publish `TokenChunk`s (and a final `StreamFinished` or `StreamFailed`) to
``rmesh.tokens.<tenant>.<request_id>`` with a per-request sequence number. Both the HTTP ingress
and `MeshClient` read them through this class, subscribed before the request is published.
A chunk that arrives ahead of a missing one is held back; if the gap does not fill quickly the
missing chunks are read back from the TOKENS stream, which keeps every chunk for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.events import StreamFailed, StreamFinished, TokenChunk, TokenEvent
from schemas.subjects import TOKENS

GAP_WAIT_S = 0.5
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
    ):
        self._nc = nc
        self.subject = subject
        self._first_timeout = first_event_timeout_s
        self._idle_timeout = idle_timeout_s
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: Subscription | None = None
        self.next_seq = 0
        self.malformed = 0

    async def open(self) -> TokenStream:
        async def on_msg(msg: Msg) -> None:
            self._queue.put_nowait(msg)

        # No flush needed: the server handles one connection's commands in order, so this
        # subscription is in place before the request published next on the same connection,
        # and so before any token that request leads to.
        self._sub = await self._nc.subscribe(self.subject, cb=on_msg)
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

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield events in order; ends after the final event; raises StreamTimeout when silent."""
        held: dict[int, TokenEvent] = {}
        while True:
            if self.next_seq in held:
                event = held.pop(self.next_seq)
            else:
                timeout = self._first_timeout if self.next_seq == 0 else self._idle_timeout
                wait = GAP_WAIT_S if held else timeout
                try:
                    msg = await asyncio.wait_for(self._queue.get(), timeout=wait)
                except TimeoutError:
                    if held:
                        for recovered in await self._read_back():
                            if recovered.seq >= self.next_seq:
                                held.setdefault(recovered.seq, recovered)
                        if self.next_seq not in held:
                            raise StreamTimeout(
                                f"token {self.next_seq} of {self.subject} is missing"
                            ) from None
                        continue
                    raise StreamTimeout(f"no token for {self.subject} within {wait:.0f}s") from None
                decoded = self._decode(msg)
                if decoded is None or decoded.seq < self.next_seq:
                    continue  # malformed, or a duplicate of one already yielded
                if decoded.seq > self.next_seq:
                    held.setdefault(decoded.seq, decoded)
                    continue
                event = decoded
            self.next_seq += 1
            yield event
            if isinstance(event, StreamFinished | StreamFailed):
                return

    async def _read_back(self) -> list[TokenEvent]:
        """Every event of this request kept on the TOKENS stream, to fill a gap."""
        js = self._nc.jetstream(timeout=5)
        events: list[TokenEvent] = []
        sub = await js.subscribe(self.subject, stream=TOKENS.name, ordered_consumer=True)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    return events
                decoded = self._decode(msg)
                if decoded is not None:
                    events.append(decoded)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


def is_final(event: TokenEvent) -> bool:
    return not isinstance(event, TokenChunk)
