"""GPU time and load for the vLLM engine, from what vLLM reports (no vLLM import here).

vLLM does not measure GPU time per request: one forward pass serves the whole batch. What it does
report is, per request, engine-core timestamps (`RequestOutput.metrics`, a `RequestStateStats`:
`scheduled_ts`, `first_token_ts`, `last_token_ts`, on the engine core's monotonic clock) and, per
engine step, the scheduler's state (`SchedulerStats.num_running_reqs`, `num_waiting_reqs`,
`kv_cache_usage`, handed to stat loggers).

GPU-seconds are derived by *processor sharing*: while n requests are running, each of them is
charged 1/n of the wall time. `ShareClock` keeps the running integral S(t) = ∫ dt / n(t); a request
running from a to b is charged S(b) - S(a). The prefill part runs from `scheduled_ts` to
`first_token_ts`, the decode part from `first_token_ts` to `last_token_ts`. Summed over requests
this gives back the GPU's busy time, and an idle GPU is charged to nobody.

It is an approximation: within a step a prefill chunk costs more than a decode token, but every
running request gets the same share (the sim engine splits a step's prefill part by tokens; vLLM
does not report per-step chunk sizes to the frontend). n(t) comes from the scheduler's stats when
vLLM sends them, else from the engine's own count of requests in flight.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class ShareClock:
    """S(t) = ∫ dt / occupancy(t) over wall time, with the history needed to read it back."""

    def __init__(self, now: float, *, max_points: int = 100_000):
        self._max_points = max_points
        # (t, S(t), occupancy during the interval that ends at t)
        self._times: list[float] = [now]
        self._values: list[float] = [0.0]
        self._occupancy: list[int] = [0]
        self._last_occupancy = 0

    def step(self, now: float, occupancy: int) -> None:
        """Close the interval since the last step: it ran with `occupancy` requests."""
        occupancy = max(0, int(occupancy))
        last_t = self._times[-1]
        if now <= last_t:
            self._last_occupancy = occupancy
            self._occupancy[-1] = occupancy
            return
        value = self._values[-1] + ((now - last_t) / occupancy if occupancy else 0.0)
        self._times.append(now)
        self._values.append(value)
        self._occupancy.append(occupancy)
        self._last_occupancy = occupancy
        if len(self._times) > 2 * self._max_points:
            del self._times[: self._max_points]
            del self._values[: self._max_points]
            del self._occupancy[: self._max_points]

    def at(self, t: float) -> float:
        """S(t); inside an interval, interpolated with that interval's occupancy; past the last
        step, extrapolated with the last occupancy seen."""
        times = self._times
        if t >= times[-1]:
            occupancy = self._last_occupancy
            return self._values[-1] + ((t - times[-1]) / occupancy if occupancy else 0.0)
        i = bisect.bisect_right(times, t)
        if i == 0:
            return self._values[0]  # older than the kept history
        occupancy = self._occupancy[i]
        return self._values[i - 1] + ((t - times[i - 1]) / occupancy if occupancy else 0.0)

    def charge(self, start: float | None, end: float | None) -> float:
        if start is None or end is None or end <= start:
            return 0.0
        return max(0.0, self.at(end) - self.at(start))


class Throughput:
    """Tokens per second over a sliding window."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, now: float, tokens: int) -> None:
        self._events.append((now, tokens))
        self._total += tokens
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        return self._total / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]


@dataclass
class SchedulerView:
    """The latest scheduler state vLLM reported, and the share clock it drives."""

    share: ShareClock
    seen: bool = False
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of GPU KV blocks in use
    preemptions: int = 0  # since start, from IterationStats.num_preempted_reqs

    def record(self, now: float, scheduler_stats: Any, iteration_stats: Any = None) -> None:
        """From vLLM's `SchedulerStats` and `IterationStats` of one step (fields read defensively:
        vLLM does not promise these classes are stable)."""
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
        if scheduler_stats is None:
            return
        self.running = int(getattr(scheduler_stats, "num_running_reqs", 0) or 0)
        self.waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0) or 0)
        usage = getattr(scheduler_stats, "kv_cache_usage", None)
        if usage is None:  # older releases
            usage = getattr(scheduler_stats, "gpu_cache_usage", 0.0)
        self.kv_usage = float(usage or 0.0)
        self.seen = True
        self.share.step(now, self.running)


@dataclass(frozen=True, slots=True)
class SequenceLoad:
    """What one of the engine's unfinished requests holds or still needs of the GPU."""

    prompt_tokens: int
    generated_tokens: int
    first_token_out: bool  # its prefill is done: it decodes in the running batch
    needs_prefill: bool  # False for a sequence whose KV was pulled from another worker
    cached_prompt_tokens: int = 0  # the prompt's leading tokens the prefix cache holds


def batch_load(sequences: Iterable[SequenceLoad], *, queue_depth: int, running: int) -> tuple[int, int]:
    """(queued_tokens, context_tokens) for the snapshot: the prompt tokens still to prefill (the
    uncached part, at least the one token every prefill computes) and the KV tokens of the
    decoding batch. vLLM does not report them, so they come from the engine's own requests
    (every request in its AsyncLLM came through it). Each is at least what the scheduler's counts
    imply (a token per waiting request, one per running one), which can run a step ahead of the
    engine's view of its requests."""
    queued = context = 0
    for seq in sequences:
        if seq.first_token_out:
            context += seq.prompt_tokens + seq.generated_tokens
        elif seq.needs_prefill:
            queued += max(1, seq.prompt_tokens - seq.cached_prompt_tokens)
    return max(queued, queue_depth), max(context, running)
