"""The order an engine serves waiting work in: a more urgent service class first (an interactive
request before a Batch API line), first come first served within a class.

What every engine that serves batch beside interactive work does (vLLM's
`scheduling_policy="priority"`, SGLang's priority scheduling): the batch fills what interactive
requests leave, and an interactive request arriving behind queued batch lines is not queued
behind them. The rank is the request's `service_class` only: its priority class (critical,
standard, sheddable) already orders it in admission's queue before it reaches a worker, and a
run of one service class is scheduled exactly as first come, first served.

The sim engine and the simulator's scheduler (services/simulator/scheduler.py) keep their
waiting and ready sequences in a `RankedQueue`; the hf engine its waiting prompts; the vLLM
engine passes the rank as vLLM's `priority` (lower first, as here).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from schemas.events import InferenceRequest

# Lower first. Every schemas.events.ServiceClass has a rank.
SERVICE_CLASS_RANK: Mapping[str, int] = {"interactive": 0, "batch": 1}
RANKS = len(SERVICE_CLASS_RANK)
LEAST_URGENT = RANKS - 1


def class_rank(service_class: str) -> int:
    """A service class's scheduling rank (0: most urgent)."""
    return SERVICE_CLASS_RANK[service_class]


def scheduling_rank(request: InferenceRequest) -> int:
    """The request's scheduling rank (0: most urgent): its service class's."""
    return SERVICE_CLASS_RANK[request.service_class]


class Ranked(Protocol):
    @property
    def rank(self) -> int: ...


T = TypeVar("T", bound=Ranked)


class RankedQueue(Generic[T]):
    """A FIFO queue per rank, read as one: the head is the oldest item of the most urgent rank,
    iteration goes rank by rank. An item's `rank` must not change while it is queued."""

    __slots__ = ("_queues", "_size")

    def __init__(self) -> None:
        self._queues: tuple[deque[T], ...] = tuple(deque() for _ in range(RANKS))
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        return itertools.chain.from_iterable(self._queues)

    def __contains__(self, item: T) -> bool:
        return item in self._queues[item.rank]

    def append(self, item: T) -> None:
        """At the back of its rank."""
        self._queues[item.rank].append(item)
        self._size += 1

    def appendleft(self, item: T) -> None:
        """At the front of its rank (a preempted sequence, first of its class again)."""
        self._queues[item.rank].appendleft(item)
        self._size += 1

    def head(self) -> T:
        """The item `popleft` takes next."""
        for queue in self._queues:
            if queue:
                return queue[0]
        raise IndexError("head of an empty RankedQueue")

    def popleft(self) -> T:
        for queue in self._queues:
            if queue:
                self._size -= 1
                return queue.popleft()
        raise IndexError("pop from an empty RankedQueue")

    def remove(self, item: T) -> None:
        self._queues[item.rank].remove(item)
        self._size -= 1
