"""A request's choices on their way to the HTTP client: each choice (`n` > 1 gives several) is
one sequence in the mesh with its own token stream; `merged` interleaves their events as they
come, for a stream's SSE chunks or one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from schemas.events import InferenceRequest, StreamFailed, StreamFinished, TokenEvent, TokenLogprob, Usage
from services.ingress import latency
from services.ingress.openai_api import ResponseShape
from services.mesh.token_stream import StreamTimeout, TokenStream


@dataclass(eq=False)
class Choice:
    prepared: InferenceRequest
    shape: ResponseShape
    tokens: TokenStream
    events: AsyncIterator[TokenEvent]
    first: TokenEvent | None = None
    ended: bool = False  # its final event came: nothing left to cancel
    # What a non-streamed response collects.
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "length"
    usage: Usage | None = None
    # For the latency histograms: when its first event came, and its trace (the exemplar).
    first_at: float | None = None
    trace_id: str | None = None

    def saw(self, event: TokenEvent | None) -> None:
        if isinstance(event, StreamFinished | StreamFailed):
            if self.ended:
                return  # its final event, seen again (the first event is seen twice)
            self.ended = True
        if isinstance(event, StreamFinished):
            self.finish_reason = event.finish_reason
            self.usage = event.usage
            latency.finished(self.prepared, self.first_at, time.time(), event.usage, self.trace_id)


async def _events_of(choice: Choice) -> AsyncIterator[TokenEvent | None]:
    """The choice's events from its first (each noted on the choice: `saw`), then None if its
    stream ended without a final one."""
    event = choice.first
    while event is not None:
        choice.saw(event)
        yield event
        if isinstance(event, StreamFinished | StreamFailed):
            return
        event = await anext(choice.events, None)
    yield None


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, TokenEvent | None]]:
    """Every choice's events as they come (None: a stream that ended without a final event),
    until each choice has ended; a stalled stream's StreamTimeout is raised here. One choice is
    read directly, several each by a task of their own, cancelled when the reader stops."""
    if len(choices) == 1:
        (choice,) = choices
        async for event in _events_of(choice):
            yield choice, event
        return
    queue: asyncio.Queue[tuple[Choice, TokenEvent | None] | StreamTimeout] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for event in _events_of(choice):
                await queue.put((choice, event))
        except StreamTimeout as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(choice), name="ingress-choice") for choice in choices]
    try:
        open_choices = len(choices)
        while open_choices:
            item = await queue.get()
            if isinstance(item, StreamTimeout):
                raise item
            if item[1] is None or isinstance(item[1], StreamFinished | StreamFailed):
                open_choices -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
