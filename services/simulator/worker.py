"""A simulated worker for the fleet simulator: the sim engine's scheduler, event-driven.

Why not the async SimEngine itself. `SimEngine` on a `VirtualClock` is exact but slow at fleet
scale: every step is an asyncio sleep, every token a future, and the clock's driver settles the
loop after each wake-up. Measured on this 2-core machine (docs/simulator.md): about 120 requests
per wall second on 64 engines, so 100,000 requests would take some 14 minutes, against a 60 s
target. This module runs the same scheduling rules as plain method calls from the simulator's
event heap, on the engine's own pure pieces:

- the engine object is built by `SimEngine(...)` (never started), so its configuration (model
  shape and dtypes, KV capacity, block size, budgets) is derived by the engine's code;
- step times and each sequence's share of a step come from its `PerfModel` (perf.py), through
  the model's own `flops`, `kv_bytes`, rates and weight bytes; `StepCost` below is
  `PerfModel.step_shares` evaluated with the decodes of a step taken together, and
  tests/test_simulator.py holds the two equal on random batches;
- KV blocks, prefix caching and eviction are the engine's `BlockManager` (blocks.py), called
  exactly as the engine calls it.

The scheduler (scheduler.py, `Scheduler`) is `SimEngine._schedule` / `_execute` rule for rule,
including the engine's ordering on its event loop; tests/test_simulator.py replays one workload
through both and compares every request's times and GPU-seconds. Sequences are seq.py's, step
costs step_cost.py's; this module adds the chunks of steady-decode steps below.

What makes it fast: steady decodes are not visited one by one each step. A sequence decoding
one token per step has, after k steps, k more tokens of context, so the batch's context sum, the
step at which each sequence needs its next KV block (by residue of its length modulo the block
size) and the step at which it finishes are all known when it joins the batch. Each step then
costs O(1) plus the sequences that cross a block boundary, finish or are being prefilled. A
decode's share of a step is affine in its context (`PerfModel.step_shares`), so per-sequence
GPU time is kept as three running sums per worker and settled when a sequence leaves the batch.
And when nothing can change a batch of steady decodes before its next finish, the steps up to it
are one chunk, one event: its end in closed form, its steps applied lazily (`advance`) when the
simulator looks at or changes the worker, bit for bit as if scheduled one by one (tested).
"""

import heapq
import math

import numpy as np

from services.simulator.scheduler import CANCELLED, FINISHED, PREFILLED, Scheduler
from services.simulator.seq import DONE, IDLE, IMPORTING, READY, RUNNING, WAITING, Seq
from services.simulator.step_cost import StepCost, _sum_of_max

__all__ = [
    "CANCELLED",
    "CHUNK_GUARD",
    "CHUNK_MAX",
    "DONE",
    "FINISHED",
    "IDLE",
    "IMPORTING",
    "PREFILLED",
    "READY",
    "RUNNING",
    "VECTOR_STEPS",
    "WAITING",
    "Seq",
    "SimWorker",
    "StepCost",
]

# The most steady-decode steps in one chunk, and how early (relative) the simulator is woken
# before a chunk's computed end.
CHUNK_MAX = 100_000
CHUNK_GUARD = 1e-9
# From this many steps on, `advance` computes them as arrays: fewer Python operations per step.
VECTOR_STEPS = 24


class SimWorker(Scheduler):
    """One worker: a `SimEngine`'s configuration and pure pieces, scheduled by the simulator.

    The simulator calls `submit` / `submit_import` for new work, `schedule` when the worker may
    start a step (it returns the step's end time, or None when idle), `end_step` at that time
    (it returns the hand-offs, in batch order), and `release` / `cancel`.
    """

    def _chunk(self, now: float, seconds: float, d0: float, d1: float) -> float | None:
        """Make this step the first of a chunk that runs to the next finish (or to the last step
        whose KV blocks are sure to be there); None when that is just this step.

        The chunk's end is known in closed form: a steady-decode step's busy time is the larger
        of two terms affine in its step counter (compute and memory, `StepCost.decodes_only`),
        so their sum over the chunk is two arithmetic series either side of a crossover. The
        simulator is woken a hair before that end; `chunk_due` then applies the steps one by one
        (`advance`, the same expressions as step-by-step scheduling, so the result is bit for bit
        the same) and names the exact end of the last one."""
        k = self.k
        keys = self._finish_keys
        finish_at = self.finish_at
        while keys[0] not in finish_at:
            heapq.heappop(keys)
        later = min(CHUNK_MAX, keys[0] - k)  # steps after this one
        if later <= 0:
            return None
        decodes = self.decoders
        available = self.blocks.available_blocks  # after this step's blocks
        if decodes * (later // self.block_size + 1) > available:
            later = self._affordable(k, later, available)
            if later <= 0:
                return None
        cost = self.cost
        base = self.context_base
        # busy(j) = max(c0 + c1 j, m0 + m1 j), j the step counter (decodes_only, term by term).
        c0 = (decodes * cost.decode_flops + cost.decode_flops_slope * base) / cost.flops_rate
        c1 = cost.decode_flops_slope * decodes / cost.flops_rate
        m0 = cost.weights_s + (decodes * cost.decode_bytes + cost.decode_bytes_slope * base) / cost.bytes_rate
        m1 = cost.decode_bytes_slope * decodes / cost.bytes_rate
        busy = _sum_of_max(c0, c1, m0, m1, k + 1, k + 1 + later)
        self._chunk_left = later
        self._chunk_blocks = decodes * (later // self.block_size + 1)
        self._chunk_step_end = now + seconds
        self._chunk_step = (d0, d1, seconds)
        self.busy = True
        self.step_end_at = end = now + seconds + later * cost.overhead + busy
        # Woken early enough that rounding never makes the wake-up late.
        return end - CHUNK_GUARD * (1.0 + end)

    def _affordable(self, k: int, later: int, available: int) -> int:
        """How many of the `later` steps after step k get their blocks without running short."""
        groups = self.groups
        size = self.block_size
        for n in range(later):
            needed = len(groups[(k + 1 + n) % size])
            if needed > available:
                return n
            available -= needed
        return later

    @property
    def in_chunk(self) -> bool:
        return self._chunk_left >= 0

    def may_evict(self, now: float) -> bool:
        """Whether `advance(now)` could evict cached blocks: False when no step of the chunk is
        due by `now`, or when every block its steps may still take is free. (Nothing but
        `advance` takes blocks during a chunk: anything else touching the worker cuts it first.
        So what the steps take comes off `free_blocks`, and the bound set at the chunk's start
        stays a bound on what is left against what is free.) A prefix match read without
        advancing then equals the one read after: the steps only take free blocks."""
        return self._chunk_left > 0 and self._chunk_step_end <= now and self._chunk_blocks > self.blocks._free

    def advance(self, now: float) -> int:
        """Apply the chunk's steps that ended by `now` (never its last: that one is `end_step`'s),
        and start the next: its KV blocks, its timing. Returns how many steps it applied."""
        left = self._chunk_left
        if left <= 0 or self._chunk_step_end > now:
            return 0
        # Steps only lengthen as contexts grow, so this many cover every step ending by `now`.
        bound = (
            left
            if now == math.inf
            else min(left, int((now - self._chunk_step_end) / self._chunk_step[2]) + 2)
        )
        if bound >= VECTOR_STEPS:
            return self._advance_arrays(now, bound)
        cost = self.cost
        overhead, alpha, beta, weights_s = cost.overhead, cost.alpha, cost.beta, cost.weights_s
        flops_rate, bytes_rate = cost.flops_rate, cost.bytes_rate
        decodes = self.decoders
        flops0, flops_slope = decodes * cost.decode_flops, cost.decode_flops_slope
        bytes0, bytes_slope = decodes * cost.decode_bytes, cost.decode_bytes_slope
        base = self.context_base
        groups = self.groups
        size = self.block_size
        grow_each_by_one = self.blocks.grow_each_by_one
        k = self.k
        acc0, acc1, acc2 = self.acc0, self.acc1, self.acc2
        busy_total = self.busy_seconds  # summed step by step, in the order `end_step` would
        end = self._chunk_step_end
        d0, d1, seconds = self._chunk_step
        applied = 0
        while left > 0 and end <= now:
            acc0 += d0
            acc1 += d1
            acc2 += d1 * k
            busy_total += seconds
            k += 1
            applied += 1
            left -= 1
            # The next step starts: the blocks its tokens cross into, and its time and shares.
            group = groups[k % size]
            if group:
                grow_each_by_one(group.values())
            context = base + decodes * k
            compute = (flops0 + flops_slope * context) / flops_rate
            memory = weights_s + (bytes0 + bytes_slope * context) / bytes_rate
            busy = compute if compute > memory else memory
            scale = busy / (decodes * alpha + weights_s + beta * context)
            seconds = overhead + busy
            d0 = overhead / decodes + (alpha + weights_s / decodes) * scale
            d1 = beta * scale
            end = end + seconds
        self.acc0, self.acc1, self.acc2 = acc0, acc1, acc2
        self.k = k
        self.busy_seconds = busy_total
        self.steps += applied
        self.generated_tokens += applied * decodes
        self._chunk_left = left
        self._chunk_step_end = end
        self._chunk_step = (d0, d1, seconds)
        return applied

    def _advance_arrays(self, now: float, bound: int) -> int:
        """`advance` for many steps at once: the loop's expressions on arrays of the next `bound`
        steps (element by element the same IEEE operations, and running sums taken in order by
        `cumsum`), so the result is the loop's, bit for bit (tested)."""
        cost = self.cost
        decodes = self.decoders
        k0 = self.k
        ks = np.arange(k0 + 1, k0 + bound + 1, dtype=np.int64)  # the steps that start
        context = self.context_base + decodes * ks
        compute = (decodes * cost.decode_flops + cost.decode_flops_slope * context) / cost.flops_rate
        memory = (
            cost.weights_s
            + (decodes * cost.decode_bytes + cost.decode_bytes_slope * context) / cost.bytes_rate
        )
        busy = np.maximum(compute, memory)
        scale = busy / (decodes * cost.alpha + cost.weights_s + cost.beta * context)
        seconds = cost.overhead + busy
        d0 = cost.overhead / decodes + (cost.alpha + cost.weights_s / decodes) * scale
        d1 = cost.beta * scale
        # Running sums, one row each, added up in order along the row by one cumsum: the steps'
        # ends (from the end of the step in flight), then the worker's totals with the step in
        # flight's terms and the next steps' after them.
        sums = np.empty((5, bound + 1))
        sums[0, 0] = self._chunk_step_end
        sums[0, 1:] = seconds
        d0_now, d1_now, seconds_now = self._chunk_step
        sums[1:, 0] = (self.acc0, self.acc1, self.acc2, self.busy_seconds)
        sums[1:, 1] = (d0_now, d1_now, d1_now * k0, seconds_now)
        sums[1, 2:] = d0[:-1]
        sums[2, 2:] = d1[:-1]
        np.multiply(d1[:-1], ks[:-1], out=sums[3, 2:])
        sums[4, 2:] = seconds[:-1]
        sums.cumsum(axis=1, out=sums)
        ends = sums[0]
        applied = min(int(ends.searchsorted(now, side="right")), bound)
        last = applied - 1
        self.acc0, self.acc1, self.acc2, self.busy_seconds = sums[1:, applied].tolist()
        # The blocks the started steps' tokens cross into.
        groups = self.groups
        size = self.block_size
        grown: list[str] = []
        if applied < size:
            for k in range(k0 + 1, k0 + applied + 1):
                group = groups[k % size]
                if group:
                    grown.extend(group.values())
        else:
            cycles, extra = divmod(applied, size)
            for residue, group in enumerate(groups):
                if group:
                    grown.extend(list(group.values()) * (cycles + ((residue - k0 - 1) % size < extra)))
        if grown:
            self.blocks.grow_each_by_one(grown)
        self.k = k0 + applied
        self.steps += applied
        self.generated_tokens += applied * decodes
        self._chunk_left -= applied
        self._chunk_step_end = float(ends[applied])
        self._chunk_step = (float(d0[last]), float(d1[last]), float(seconds[last]))
        if applied == bound and self._chunk_left > 0:
            applied += self.advance(now)
        return applied

    def chunk_due(self, now: float) -> float | None:
        """At the chunk's wake-up: apply its steps; the exact end of its last step if that is
        still to come (the simulator waits for it), else None (the step ends now)."""
        self.advance(now)
        if self._chunk_step_end > now:
            self.step_end_at = self._chunk_step_end
            return self._chunk_step_end
        return None

    def interrupt(self, now: float) -> float | None:
        """Something is about to change the worker at `now`: a chunk stops after its step in
        flight. Returns that step's end when the chunk was cut (the simulator's new step event)."""
        if self._chunk_left <= 0:
            return None
        self.advance(now)
        if self._chunk_left <= 0:
            return None
        self._chunk_left = 0
        self.step_end_at = self._chunk_step_end
        return self._chunk_step_end
