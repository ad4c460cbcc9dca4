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

The scheduler is `SimEngine._schedule` / `_execute` rule for rule (chunked prefill, decodes
first, block-by-block growth with recompute preemption of the newest sequence, no admissions in a
step that preempted, imports that bypass `max_running`), including the engine's ordering on its
event loop: what a step's end hands to other coroutines (a prefilled sequence's `decode()` call,
a finished sequence's `release()`) lands after the engine has already scheduled its next step.
tests/test_simulator.py replays one workload through both and compares every request's times
and GPU-seconds.

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

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from services.engines.sim.blocks import BlockManager
from services.engines.sim.engine import SimEngine
from services.engines.sim.perf import PerfModel

# Sequence states (SimEngine's `State`, as small ints).
WAITING, RUNNING, IMPORTING, IDLE, READY, DONE = range(6)

# The most steady-decode steps in one chunk, and how early (relative) the simulator is woken
# before a chunk's computed end.
CHUNK_MAX = 100_000
CHUNK_GUARD = 1e-9
# From this many steps on, `advance` computes them as arrays: fewer Python operations per step.
VECTOR_STEPS = 24

# What a step's end hands on, in the step's batch order (the simulator acts on them after the
# worker has scheduled its next step, as the engine's consumers do).
PREFILLED, FINISHED, CANCELLED = range(3)


class Seq:
    """One request on one worker (SimEngine's `_Sequence`)."""

    __slots__ = (
        "a0",
        "a1",
        "a2",
        "admitted_at",
        "admitted_once",
        "base",
        "cached_tokens",
        "cancel",
        "computed",
        "dec",
        "decode_s",
        "decoding",
        "enqueued_at",
        "first_done",
        "generated",
        "hashes",
        "k0",
        "kfin",
        "kv_import",
        "max_tokens",
        "order",
        "owner",
        "preemptions",
        "prefill_s",
        "prompt_len",
        "rid",
        "state",
    )

    def __init__(
        self, rid: str, prompt_len: int, hashes: list[int], max_tokens: int, owner: Any, *, kv_import: bool
    ):
        self.rid = rid
        self.prompt_len = prompt_len
        self.hashes = hashes
        self.max_tokens = max_tokens
        self.owner = owner
        self.kv_import = kv_import
        self.state = WAITING
        self.computed = 0
        self.generated = 0
        self.cached_tokens = 0
        self.admitted_once = False
        self.decoding = False
        # Imported KV never had a first-token future here: all its GPU time is decode time.
        self.first_done = kv_import
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.preemptions = 0
        self.order = 0
        self.dec = False  # in the steady-decode group
        self.k0 = 0
        self.base = 0
        self.kfin = 0
        self.a0 = self.a1 = self.a2 = 0.0
        self.cancel = False
        self.enqueued_at = 0.0
        self.admitted_at = -1.0


class StepCost:
    """`PerfModel.step_shares` for a batch of explicit parts plus `decodes` one-token decodes
    whose contexts sum to `decode_context`, without listing the decodes.

    Built from the model's own pieces (`flops`, `kv_bytes`, `flops_per_s`, `bytes_per_s`,
    `weight_read_bytes`, `step_overhead_s`). A decode's own work is affine in its context c:
    `alpha + wt + beta * c`, with alpha and beta read off the model at c = 0 and c = 1.
    """

    __slots__ = (
        "alpha",
        "beta",
        "bytes_rate",
        "decode_bytes",
        "decode_bytes_slope",
        "decode_flops",
        "decode_flops_slope",
        "flops_per_pair",
        "flops_per_part",
        "flops_per_token",
        "flops_rate",
        "kv_per_token",
        "overhead",
        "perf",
        "weights",
        "weights_s",
    )

    def __init__(self, perf: PerfModel):
        self.perf = perf
        self.flops_rate = perf.flops_per_s
        self.bytes_rate = perf.bytes_per_s
        self.weights = perf.model.weight_read_bytes
        self.weights_s = self.weights / self.bytes_rate
        self.overhead = perf.step_overhead_s
        # A one-token decode after c tokens: flops(1, 1, c + 1) and kv_bytes(c, 1), both affine in c.
        f1 = perf.flops(1, 1, 1.0)
        f2 = perf.flops(1, 1, 2.0)
        b0 = perf.kv_bytes(0, 1)
        b1 = perf.kv_bytes(1, 1)
        self.decode_flops, self.decode_flops_slope = f1, f2 - f1
        self.decode_bytes, self.decode_bytes_slope = b0, b1 - b0
        self.alpha = f1 / self.flops_rate + b0 / self.bytes_rate
        self.beta = (f2 - f1) / self.flops_rate + (b1 - b0) / self.bytes_rate
        # `flops` and `kv_bytes` are linear: their coefficients, read off at unit arguments (exact:
        # the model's own products), give the same sums term for term without the calls.
        self.flops_per_token = perf.flops(1, 0, 0.0)
        self.flops_per_part = perf.flops(0, 1, 0.0)
        self.flops_per_pair = perf.flops(0, 0, 1.0)
        self.kv_per_token = perf.kv_bytes(1, 0)

    def decodes_only(self, decodes: int, decode_context: int) -> tuple[float, float, float]:
        """`__call__` for a step of decodes alone: (step seconds, share at context 0, slope)."""
        busy = max(
            (decodes * self.decode_flops + self.decode_flops_slope * decode_context) / self.flops_rate,
            self.weights_s
            + (decodes * self.decode_bytes + self.decode_bytes_slope * decode_context) / self.bytes_rate,
        )
        scale = busy / (decodes * self.alpha + self.weights_s + self.beta * decode_context)
        return (
            self.overhead + busy,
            self.overhead / decodes + (self.alpha + self.weights_s / decodes) * scale,
            self.beta * scale,
        )

    def __call__(
        self, parts: list[tuple[int, int]], decodes: int, decode_context: int
    ) -> tuple[float, list[float], float, float]:
        """(step seconds, each part's share, a decode's share at context 0, the slope of a
        decode's share per context token)."""
        flops_rate, bytes_rate = self.flops_rate, self.bytes_rate
        per_token, per_part, per_pair = self.flops_per_token, self.flops_per_part, self.flops_per_pair
        kv = self.kv_per_token
        new = decodes
        read = decode_context
        pairs = float(decode_context + decodes)
        part_pairs: list[float] = []
        for n, c in parts:
            p = n * c + n * (n + 1) / 2.0
            part_pairs.append(p)
            new += n
            read += c
            pairs += p
        count = len(parts) + decodes
        flops = per_token * new + per_part * count + per_pair * pairs
        nbytes = (read + new) * kv
        busy = max(flops / flops_rate, (self.weights + nbytes) / bytes_rate)
        wt = self.weights / bytes_rate / (new or 1)
        own = [
            (per_token * n + per_part + per_pair * p) / flops_rate + (c + n) * kv / bytes_rate + wt * n
            for (n, c), p in zip(parts, part_pairs, strict=True)
        ]
        decode_own0 = self.alpha + wt
        total = sum(own) + decodes * decode_own0 + self.beta * decode_context
        scale = busy / total
        overhead = self.overhead / count
        shares = [overhead + o * scale for o in own]
        return self.overhead + busy, shares, overhead + decode_own0 * scale, self.beta * scale


class SimWorker:
    """One worker: a `SimEngine`'s configuration and pure pieces, scheduled by the simulator.

    The simulator calls `submit` / `submit_import` for new work, `schedule` when the worker may
    start a step (it returns the step's end time, or None when idle), `end_step` at that time
    (it returns the hand-offs, in batch order), and `release` / `cancel`.
    """

    def __init__(
        self,
        worker_id: str,
        engine: SimEngine,
        *,
        pool: str,
        role: str,
        tensor_parallel: int,
        on_import_admitted: Callable[[SimWorker, Seq, float], None] | None = None,
        on_first_block: Callable[[SimWorker, int], None] | None = None,
    ):
        self.worker_id = worker_id
        self.engine = engine  # built, never started: configuration and pure pieces only
        self.pool = pool
        self.role = role
        self.tensor_parallel = tensor_parallel
        self.model = engine.info.model
        self.gpu_type = engine.info.gpu_type
        self.perf: PerfModel = engine.perf
        self.blocks: BlockManager = engine.blocks
        self.blocks.record_events = False  # the simulator's prefix view reads the caches themselves
        self.block_size = engine.info.block_size
        self.max_batch_tokens = engine.max_batch_tokens
        self.max_running = engine.max_running
        self.max_context_tokens = engine.max_context_tokens
        if self.max_running > self.max_batch_tokens:
            raise ValueError("the simulator needs max_running <= max_batch_tokens (every decode fits a step)")
        self.cost = StepCost(self.perf)
        self.on_import_admitted = on_import_admitted
        # Told when the cache stores a prompt's first block (the simulator's prefix index).
        self.on_first_block = on_first_block
        self.waiting: deque[Seq] = deque()
        self.ready: deque[Seq] = deque()
        self.running: dict[Seq, None] = {}  # admission order
        self.prefilling: dict[Seq, None] = {}  # running, not steady decodes, admission order
        # Steady decodes by the residue of their step's token position that starts a KV block
        # (seq -> its id in the block manager).
        self.groups: list[dict[Seq, str]] = [{} for _ in range(self.block_size)]
        self.finish_at: dict[int, list[Seq]] = {}
        self._finish_keys: list[int] = []  # a heap of finish_at's keys (stale ones popped lazily)
        self.decoders = 0
        self.context_base = 0  # sum over steady decodes of (computed - K at join)
        self.k = 0  # steady-decode steps so far
        self.acc0 = self.acc1 = self.acc2 = 0.0
        self._order = itertools.count()
        # The step in flight.
        self.busy = False
        self.step_end_at = 0.0
        self._parts: list[tuple[Seq, int]] = []
        self._shares: list[float] = []
        self._d0 = 0.0
        self._d1 = 0.0
        self._seconds = 0.0
        self._cancelled: list[Seq] = []
        # A chunk of steady-decode steps (see `schedule`): how many steps follow the one in
        # flight, when that one ends, and its (share at context 0, slope, seconds).
        self._chunk_left = -1  # -1: no chunk
        self._chunk_step_end = 0.0
        self._chunk_step = (0.0, 0.0, 0.0)
        # At most the KV blocks the chunk's steps after the one in flight take (`may_evict`).
        self._chunk_blocks = 0
        # Statistics.
        self.steps = 0
        self.busy_seconds = 0.0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.resident = 0  # sequences holding or waiting for this worker's resources
        self.reserved = 0  # requests placed here whose KV is still being prefilled elsewhere
        # Fleet bookkeeping (the simulator's).
        self.provisioned_at = 0.0
        self.ready_at = 0.0
        self.removed_at: float | None = None
        self.draining = False
        self.kick_pending = False
        self.step_version = 0  # the simulator's current step event for this worker

    # ------------------------------------------------------------ state for heartbeats

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running_count(self) -> int:
        return len(self.running) + len(self.ready)

    @property
    def idle(self) -> bool:
        return self.resident == 0 and not self.busy

    def context_tokens(self) -> int:
        """The running sequences' tokens so far (prompt + generated), as of the steps applied: a
        steady decode's are kept in the worker's running sums (`base + k` computed, one more
        generated), not on the sequence."""
        prefilling = sum(seq.prompt_len + seq.generated for seq in self.prefilling)
        return self.context_base + self.decoders * (self.k + 1) + prefilling

    # ------------------------------------------------------------ admission of work

    def check(self, prompt_len: int, max_tokens: int) -> tuple[str, str] | None:
        """SimEngine._check's verdict on a request's size: (code, message), or None if it fits."""
        if prompt_len == 0:
            return ("invalid", "empty prompt")
        total = prompt_len + max_tokens
        if total > self.max_context_tokens:
            return (
                "invalid",
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the model's context "
                f"of {self.max_context_tokens} tokens",
            )
        if self.blocks.blocks_for(total) > self.blocks.total_blocks:
            return ("capacity", "request needs more KV blocks than this engine has")
        return None

    def submit(self, seq: Seq, now: float) -> None:
        """`SimEngine.prefill`: the prompt joins the waiting queue."""
        seq.state = WAITING
        seq.enqueued_at = now
        self.waiting.append(seq)
        self.resident += 1

    def submit_import(self, seq: Seq, now: float) -> None:
        """`SimEngine.import_kv`: a prefilled request's KV is to arrive; it waits for blocks."""
        seq.kv_import = True
        seq.first_done = True
        seq.state = WAITING
        seq.enqueued_at = now
        self.waiting.append(seq)
        self.resident += 1

    def kv_transfer_seconds(self, seq: Seq) -> float:
        """The transfer time of an admitted import: the blocks this worker does not cache."""
        return self.perf.kv_transfer_seconds((seq.prompt_len - seq.cached_tokens) * self.kv_bytes_per_token)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.perf.model.kv_bytes_per_token

    def import_done(self, seq: Seq) -> bool:
        """The import's transfer ended; False when the sequence was released meanwhile."""
        if seq.state != IMPORTING:
            return False
        seq.computed = seq.prompt_len
        seq.state = IDLE
        self.blocks.mark_computed(seq.rid, seq.prompt_len)
        if seq.hashes and self.on_first_block is not None:
            self.on_first_block(self, seq.hashes[0])
        return True

    def start_decode(self, seq: Seq) -> bool:
        """`SimEngine.decode`: an idle (prefilled or imported) sequence asks for its tokens.

        Returns True when it has nothing left to generate (the engine's immediate "length")."""
        if seq.generated < 1:
            seq.generated = 1  # the first token came from prefill
        if seq.generated >= seq.max_tokens:
            return True
        seq.decoding = True
        seq.state = READY
        self.ready.append(seq)
        return False

    def release(self, seq: Seq) -> None:
        """`SimEngine.release`: drop the sequence from wherever it is; its full blocks stay cached."""
        state = seq.state
        if state == DONE and not self.blocks.holds(seq.rid) and seq not in self.running:
            return
        if state == WAITING:
            self.waiting.remove(seq)
        elif state == READY:
            self.ready.remove(seq)
        elif state == RUNNING:
            self._drop_running(seq)
        seq.state = DONE
        self.blocks.free(seq.rid)
        self.resident -= 1

    def cancel(self, seq: Seq) -> bool:
        """A client gave up on the sequence. True: released now. False: it is in the step in flight;
        `end_step` credits it its share of that step and hands it back as CANCELLED."""
        if seq.state == DONE:
            return True
        if self.busy and seq.state == RUNNING and (seq.dec or any(s is seq for s, _ in self._parts)):
            if not seq.cancel:
                seq.cancel = True
                self._cancelled.append(seq)
            return False
        self.release(seq)
        return True

    # ------------------------------------------------------------ steady-decode bookkeeping

    def _admit(self, seq: Seq) -> None:
        seq.state = RUNNING
        seq.order = next(self._order)
        self.running[seq] = None

    def _join_decoders(self, seq: Seq) -> None:
        """The sequence decodes one token per step from now on."""
        k = self.k
        seq.dec = True
        seq.k0 = k
        seq.base = base = seq.computed - k
        seq.a0, seq.a1, seq.a2 = self.acc0, self.acc1, self.acc2
        self.groups[(-base) % self.block_size][seq] = seq.rid
        self.decoders += 1
        self.context_base += base
        # Its last step: the one after which `generated` reaches max_tokens.
        seq.kfin = kfin = k + seq.max_tokens - seq.generated - 1
        bucket = self.finish_at.get(kfin)
        if bucket is None:
            self.finish_at[kfin] = [seq]
            heapq.heappush(self._finish_keys, kfin)
        else:
            bucket.append(seq)

    def _leave_decoders(self, seq: Seq) -> None:
        """Settle the sequence's tokens and GPU time since it joined, and take it out of the group."""
        base = seq.base
        seq.decode_s += (self.acc0 - seq.a0) + base * (self.acc1 - seq.a1) + (self.acc2 - seq.a2)
        steps = self.k - seq.k0
        seq.generated += steps
        seq.computed += steps
        del self.groups[(-base) % self.block_size][seq]
        self.decoders -= 1
        self.context_base -= base
        seq.dec = False

    def _drop_running(self, seq: Seq) -> None:
        if seq.dec:
            self._leave_decoders(seq)
        else:
            self.prefilling.pop(seq, None)
        del self.running[seq]

    def _preempt(self, seq: Seq) -> None:
        """Recompute-style (SimEngine._preempt): free its KV; it prefills prompt + output again."""
        self._drop_running(seq)
        self.blocks.free(seq.rid)
        seq.computed = 0
        seq.state = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _grow_exact(self) -> bool:
        """SimEngine._schedule step 2 when the free blocks may not cover this step's boundary
        crossings: decodes in admission order, preempting the newest sequence until each fits."""
        running = self.running
        blocks = self.blocks
        k = self.k
        size = self.block_size
        preempted = False
        for seq in list(running):
            if seq.state != RUNNING or not seq.dec:
                continue
            computed = seq.base + k
            if computed % size:
                continue
            while not blocks.grow(seq.rid, computed + 1):
                victim = next(reversed(running))
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
        return preempted

    # ------------------------------------------------------------ the scheduler

    def schedule(self, now: float, *, coast: bool = True) -> float | None:
        """SimEngine._schedule, then the step's duration. Returns when the step ends (None: idle).

        When the step holds steady decodes only and nothing can change the batch before its next
        finish (no prompt to prefill or admit, no decode waiting for a slot it could get, and
        `coast`: the simulator has nothing to hand the worker now), the steps up to that finish
        are one chunk (`_chunk`): the worker is busy until the chunk's last step ends, and
        `advance` applies its steps lazily, when the simulator looks at the worker or interrupts
        the chunk (`interrupt`)."""
        if self.busy:
            return self.step_end_at
        blocks = self.blocks
        running = self.running
        size = self.block_size
        budget = self.max_batch_tokens
        # 1. Decodes asked for join the batch.
        ready = self.ready
        while ready and len(running) < self.max_running:
            seq = ready.popleft()
            self._admit(seq)
            self._join_decoders(seq)
        # 2. Every steady decode gets a token, and a block when its token starts one.
        preempted = False
        if self.decoders:
            group = self.groups[self.k % size]
            if group:
                if len(group) <= blocks.available_blocks:
                    blocks.grow_each_by_one(group.values())
                else:
                    preempted = self._grow_exact()
            budget -= self.decoders
        # 3. Prompts part-way through their prefill (or recompute) continue.
        parts: list[tuple[Seq, int]] = []
        if budget > 0:
            for seq in self.prefilling:
                take = seq.prompt_len + seq.generated - seq.computed
                if take > budget:
                    take = budget
                parts.append((seq, take))
                budget -= take
                if budget <= 0:
                    break
        # 4. New prompts, in order, while there is room; none in a step that preempted.
        blocked = True  # the waiting queue's head cannot start until a sequence leaves
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0:
                seq = waiting[0]
                imported = seq.kv_import
                if not imported and len(running) >= self.max_running:
                    break
                tokens = seq.prompt_len if imported else seq.prompt_len + seq.generated
                matched = blocks.allocate(seq.rid, seq.hashes, tokens)
                if matched is None:
                    break
                blocked = False
                waiting.popleft()
                cached = matched * size
                limit = tokens if imported else tokens - 1
                if cached > limit:
                    cached = limit
                if not seq.admitted_once:
                    seq.cached_tokens = cached
                    seq.admitted_once = True
                    seq.admitted_at = now
                if imported:
                    seq.state = IMPORTING
                    if self.on_import_admitted is not None:
                        self.on_import_admitted(self, seq, now)
                    continue
                seq.computed = cached
                self._admit(seq)
                self.prefilling[seq] = None
                take = tokens - cached
                if take > budget:
                    take = budget
                parts.append((seq, take))
                budget -= take
        decodes = self.decoders
        if parts:
            seconds, shares, d0, d1 = self.cost(
                [(n, seq.computed) for seq, n in parts], decodes, self.context_base + decodes * self.k
            )
            self._parts = parts
            self._shares = shares
        elif decodes:
            seconds, d0, d1 = self.cost.decodes_only(decodes, self.context_base + decodes * self.k)
            if coast and blocked and not preempted and (not ready or len(running) >= self.max_running):
                end = self._chunk(now, seconds, d0, d1)
                if end is not None:
                    return end
        else:
            return None
        self._d0 = d0
        self._d1 = d1
        self._seconds = seconds
        self.busy = True
        self.step_end_at = end = now + seconds
        return end

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

    def end_step(self, now: float) -> list[tuple[int, Seq]]:
        """SimEngine._execute at the step's end: what it hands on, in batch order."""
        if self._chunk_left >= 0:
            self.advance(math.inf)
            self._d0, self._d1, self._seconds = self._chunk_step
            self._chunk_left = -1
        self.busy = False
        self.busy_seconds += self._seconds
        self.steps += 1
        handoffs: list[tuple[int, Seq]] = []
        emitted = 0
        decodes = self.decoders
        if decodes:
            k = self.k
            d1 = self._d1
            self.acc0 += self._d0
            self.acc1 += d1
            self.acc2 += d1 * k
            self.k = k + 1
            emitted += decodes
            finishing = self.finish_at.pop(k, None)
            if finishing:
                done = [s for s in finishing if s.dec and s.kfin == k and not s.cancel]
                if len(done) > 1:
                    done.sort(key=_order_of)
                for seq in done:
                    self._leave_decoders(seq)
                    del self.running[seq]
                    seq.state = DONE
                    handoffs.append((FINISHED, seq))
        if not self._parts:
            if self._cancelled:
                self._end_cancelled(handoffs)
            self.generated_tokens += emitted
            return handoffs
        blocks = self.blocks
        size = self.block_size
        for (seq, n), share in zip(self._parts, self._shares, strict=True):
            if seq.first_done:
                seq.decode_s += share
            else:
                seq.prefill_s += share
            if seq.cancel or seq.state != RUNNING:
                continue
            before = seq.computed
            seq.computed = computed = before + n
            if n > 1 or not seq.decoding:
                self.prefill_tokens += n
            if before < seq.prompt_len:
                blocks.mark_computed(seq.rid, computed)
                if before < size <= computed and seq.hashes and self.on_first_block is not None:
                    self.on_first_block(self, seq.hashes[0])
            if computed < seq.prompt_len + seq.generated:
                continue  # a prefill chunk short of the prompt's end
            seq.generated += 1
            emitted += 1
            del self.prefilling[seq]
            if not seq.decoding:
                # The prompt's prefill is done: its first token; it waits for decode or release.
                del self.running[seq]
                seq.state = IDLE
                seq.first_done = True
                handoffs.append((PREFILLED, seq))
            elif seq.generated >= seq.max_tokens:
                del self.running[seq]
                seq.state = DONE
                handoffs.append((FINISHED, seq))
            else:
                self._join_decoders(seq)
        self.generated_tokens += emitted
        if self._cancelled:
            self._end_cancelled(handoffs)
        self._parts = []
        self._shares = []
        return handoffs

    def _end_cancelled(self, handoffs: list[tuple[int, Seq]]) -> None:
        for seq in self._cancelled:
            seq.cancel = False
            if seq.state == RUNNING:
                self._drop_running(seq)
                seq.state = IDLE  # released by the simulator with the hand-off
            handoffs.append((CANCELLED, seq))
        self._cancelled = []

    def gpu_seconds(self, seq: Seq) -> float:
        """The sequence's GPU time so far on this worker (prefill + decode), steady decodes settled."""
        extra = 0.0
        if seq.dec:
            extra = (self.acc0 - seq.a0) + seq.base * (self.acc1 - seq.a1) + (self.acc2 - seq.a2)
        return seq.prefill_s + seq.decode_s + extra


def _order_of(seq: Seq) -> int:
    return seq.order


def _sum_of_max(c0: float, c1: float, m0: float, m1: float, first: int, stop: int) -> float:
    """The sum over j in [first, stop) of max(c0 + c1 j, m0 + m1 j)."""

    def series(a: float, b: float, lo: int, hi: int) -> float:
        n = hi - lo
        return n * a + b * (lo + hi - 1) * n / 2.0 if n > 0 else 0.0

    if c1 == m1:
        return series(c0, c1, first, stop) if c0 >= m0 else series(m0, m1, first, stop)
    # The two lines cross once; each dominates on one side.
    cross = (m0 - c0) / (c1 - m1)
    split = min(max(math.ceil(cross), first), stop)
    if c1 > m1:  # compute dominates from the crossing on
        return series(m0, m1, first, split) + series(c0, c1, split, stop)
    return series(c0, c1, first, split) + series(m0, m1, split, stop)
