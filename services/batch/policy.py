"""How many Batch API lines to release now: pure (state in, a decision out, the clock passed in).

A batch is the lowest work the fleet does. It fills the spare capacity of the decode workers
and gives way at once to interactive traffic:

- **spare capacity**: each live, not draining decode worker offers `slots_per_worker` times
  `target_occupancy` sequences, none while its KV cache is `kv_high` full; the interactive
  load is what its heartbeat says it runs and queues, less the batch's own lines in flight
  (which it counts too). What is left, less the lines in flight, may be released, at most
  `max_release` at once and `max_in_flight` in all;
- **interactive pressure** pauses it: an interactive request admission deferred (or refused for
  capacity) within `pressure_hold_s`, or workers queueing more than `queue_per_worker`
  requests each beyond the batch's own lines;
- **pushback**: one of its own lines refused for capacity or quota backs off `pushback_s`.

Lines already released are never recalled: a paused batch lets them finish (they are admitted
at the lowest class and level, so admission serves them last anyway).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol


class Heartbeat(Protocol):
    """What a decode worker's heartbeat says (`WorkerState`, or the router's view of one)."""

    @property
    def running(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def kv_blocks_used(self) -> int: ...
    @property
    def kv_blocks_total(self) -> int: ...
    @property
    def draining(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A decode worker's latest heartbeat, as the policy needs it."""

    running: int
    queue_depth: int
    kv_used: float  # fraction of its KV blocks in use, 0-1
    draining: bool = False

    @classmethod
    def of(cls, state: Heartbeat) -> WorkerLoad:
        used = state.kv_blocks_used / state.kv_blocks_total if state.kv_blocks_total else 0.0
        return cls(
            running=state.running, queue_depth=state.queue_depth, kv_used=used, draining=state.draining
        )


@dataclass(frozen=True, slots=True)
class BatchLimits:
    slots_per_worker: int = 8
    target_occupancy: float = 0.75
    kv_high: float = 0.85
    queue_per_worker: float = 0.5
    pressure_hold_s: float = 5.0
    pushback_s: float = 2.0
    max_in_flight: int = 64
    max_release: int = 16


@dataclass(frozen=True, slots=True)
class RunnerState:
    """What the runner holds: lines waiting to run, lines submitted and not finished, and when
    it last saw interactive pressure or had one of its own lines pushed back (None: never)."""

    pending: int
    in_flight: int
    last_pressure_at: float | None = None
    last_pushback_at: float | None = None


Reason = Literal[
    "nothing_pending",
    "no_workers",
    "interactive_pressure",
    "pushback",
    "fleet_queueing",
    "no_spare_capacity",
    "released",
]


@dataclass(frozen=True, slots=True)
class Release:
    count: int
    reason: Reason
    # Sequences the fleet could take for the batch now (before the lines in flight).
    spare_slots: int = 0
    # Sequences the interactive traffic is running or queueing.
    interactive_load: int = 0


def interactive_load(workers: Sequence[WorkerLoad], in_flight: int) -> int:
    """What the fleet runs and queues that is not the batch's (heartbeats count both)."""
    return max(0, sum(w.running + w.queue_depth for w in workers) - in_flight)


def release(workers: Sequence[WorkerLoad], state: RunnerState, limits: BatchLimits, now: float) -> Release:
    """How many lines to submit now, and why that many."""
    if state.pending <= 0:
        return Release(0, "nothing_pending")
    live = [w for w in workers if not w.draining]
    if not live:
        return Release(0, "no_workers")
    load = interactive_load(live, state.in_flight)
    if state.last_pressure_at is not None and now - state.last_pressure_at < limits.pressure_hold_s:
        return Release(0, "interactive_pressure", interactive_load=load)
    if state.last_pushback_at is not None and now - state.last_pushback_at < limits.pushback_s:
        return Release(0, "pushback", interactive_load=load)
    # Queued requests beyond the batch's own lines (which may wait at a worker for a moment).
    queued = max(0, sum(w.queue_depth for w in live) - state.in_flight)
    if queued > limits.queue_per_worker * len(live):
        return Release(0, "fleet_queueing", interactive_load=load)
    slots = sum(
        math.floor(limits.slots_per_worker * limits.target_occupancy)
        for w in live
        if w.kv_used < limits.kv_high
    )
    spare = max(0, slots - load)
    count = min(
        spare - state.in_flight,
        limits.max_in_flight - state.in_flight,
        limits.max_release,
        state.pending,
    )
    if count <= 0:
        return Release(0, "no_spare_capacity", spare_slots=spare, interactive_load=load)
    return Release(count, "released", spare_slots=spare, interactive_load=load)


def expired(expires_at: float, now: float) -> bool:
    """A batch past its completion window: what has not run is not run."""
    return now >= expires_at
