"""The sim engine's scheduler as plain method calls: `SimEngine._schedule` / `_execute` rule
for rule (chunked prefill, decodes first, block-by-block growth with recompute preemption of the
newest sequence of the least urgent class, no admissions in a step that preempted, imports that
bypass `max_running`, waiting work the more urgent service class first) on
the engine's own `PerfModel` (through `StepCost`) and `BlockManager`, with the worker's state
for heartbeats and the simulator's fleet bookkeeping. `SimWorker` (worker.py) adds the chunks of
steady-decode steps timed ahead and applied lazily.

The engine's ordering on its event loop is kept: what a step's end hands to other coroutines (a
prefilled sequence's `decode()` call, a finished sequence's `release()`) lands after the engine
has already scheduled its next step. tests/test_simulator.py replays one workload through both
and compares every request's times and GPU-seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Self

from services.engines.scheduling import LEAST_URGENT, RankedQueue
from services.engines.sim.blocks import BlockManager
from services.engines.sim.engine import SimEngine
from services.engines.sim.perf import PerfModel
from services.simulator.seq import (
    DONE,
    IDLE,
    IMPORTING,
    READY,
    RUNNING,
    WAITING,
    Seq,
    _order_of,
    _rank_of,
)
from services.simulator.step_cost import StepCost

# What a step's end hands on, in the step's batch order (the simulator acts on them after the
# worker has scheduled its next step, as the engine's consumers do).
PREFILLED, FINISHED, CANCELLED = range(3)


class Scheduler:
    """A worker's state and the engine's scheduling rules on it."""

    def __init__(
        self,
        worker_id: str,
        engine: SimEngine,
        *,
        pool: str,
        role: str,
        tensor_parallel: int,
        on_import_admitted: Callable[[Self, Seq, float], None] | None = None,
        on_first_block: Callable[[Self, int], None] | None = None,
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
        # In order within each scheduling rank, the more urgent rank first (SimEngine's).
        self.waiting: RankedQueue[Seq] = RankedQueue()
        self.ready: RankedQueue[Seq] = RankedQueue()
        # A sequence of a rank past 0 has been here: the order by rank can differ from admission
        # order (until then the steps skip sorting by rank).
        self.ranked = False
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
        if seq.rank:
            self.ranked = True
        seq.state = WAITING
        seq.enqueued_at = now
        self.waiting.append(seq)
        self.resident += 1

    def submit_import(self, seq: Seq, now: float) -> None:
        """`SimEngine.import_kv`: a prefilled request's KV is to arrive; it waits for blocks."""
        seq.kv_import = True
        seq.first_done = True
        if seq.rank:
            self.ranked = True
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

    def import_done(self: Self, seq: Seq) -> bool:
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
        crossings: decodes the more urgent class first, in admission order within a class,
        preempting the newest sequence of the least urgent class (`_victim`) until each fits."""
        running = self.running
        blocks = self.blocks
        k = self.k
        size = self.block_size
        preempted = False
        for seq in sorted(running, key=_rank_of) if self.ranked else list(running):
            if seq.state != RUNNING or not seq.dec:
                continue
            computed = seq.base + k
            if computed % size:
                continue
            while not blocks.grow(seq.rid, computed + 1):
                victim = self._victim(seq)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
        return preempted

    def _victim(self, seq: Seq) -> Seq:
        """SimEngine._victim: the most recently admitted running sequence of the least urgent
        class, but for the steady decodes before `seq` in the step's order (by class, then
        admission). With one class, the newest."""
        if not self.ranked:
            return next(reversed(self.running))
        rank, order = seq.rank, seq.order
        victim = seq
        for other in reversed(self.running):  # the newest first
            if other.dec and (other.rank < rank or (other.rank == rank and other.order < order)):
                continue  # its token is in the step already
            if other.rank > victim.rank or (other.rank == victim.rank and other.order > victim.order):
                victim = other
                if victim.rank == LEAST_URGENT:
                    break
        return victim

    # ------------------------------------------------------------ the scheduler

    def schedule(self: Self, now: float, *, coast: bool = True) -> float | None:
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
        # 4. New prompts, the more urgent class first and in order within it, while there is
        # room; none in a step that preempted.
        blocked = True  # the waiting queue's head cannot start until a sequence leaves
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0:
                seq = waiting.head()
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

    # ------------------------------------------------------------ chunks (SimWorker's, worker.py)

    def _chunk(self, now: float, seconds: float, d0: float, d1: float) -> float | None:
        """Make this step the first of a chunk of steady-decode steps; None when that is just
        this step."""
        raise NotImplementedError

    def advance(self, now: float) -> int:
        """Apply the chunk's steps that ended by `now`; returns how many."""
        raise NotImplementedError

    # ------------------------------------------------------------ the step's end

    def end_step(self: Self, now: float) -> list[tuple[int, Seq]]:
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
