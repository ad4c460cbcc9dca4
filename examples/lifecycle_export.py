"""A lifecycle exporter: one row per request (who, what, where it ran, how long it took, how it
ended, its prompt's block hashes) in Parquet files that pandas or duckdb read, and that
`to_mooncake_jsonl` turns into a trace the simulator replays.

    RIPPLEMESH_LIFECYCLE_DIR=lifecycle ripplemesh run-subscriber examples.lifecycle_export:exporter \\
        --nats-url nats://127.0.0.1:4222 --nats-credentials .ripplemesh/credentials/services.json

Each request's events are folded into its row as they come: the lifecycle events
(``rmesh.events.>``, the subscriber's own consumer) and its `RequestPrepared` (``rmesh.prepared.*``
on the REQUESTS stream, through a second consumer: the one event that carries the prompt's
length and block hashes, the model, `max_tokens` and `submitted_at`). So it runs as the
services' NATS user: the subscribers' may not read REQUESTS (with
``RIPPLEMESH_LIFECYCLE_PREPARED=0`` it does without, and its rows without those columns).

A row is written once its request has ended (completed, failed, rejected or cancelled) and
`settle_s` has passed, for the events of two streams (its RequestPrepared, a worker's
WorkStopped) that come in another order; rows go out in batches (`flush_rows`, or every
`flush_every_s`, and on stop) as ``part-<n>.parquet`` files, each written under a dot-name and
renamed whole, so a reader of the directory never sees half a file.

Idempotent: an event id already folded into a request is not folded again, and an event for a
request already written is ignored (counted `late`). Bounded: a request that has not ended
`request_timeout_s` after its first event, or the oldest beyond `max_in_flight`, is dropped
(counted `dropped`). A durable exporter stopped (SIGTERM) keeps its requests in flight in
``_state.msgpack`` beside the parts and takes them up again when started; one killed loses them,
and the rows not yet flushed, since the SDK acks an event once its handler has returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from prometheus_client import Counter

from ripplemesh import Context, Subscriber
from schemas.events import (
    AdmissionDecision,
    DecodeCompleted,
    PrefillCompleted,
    RequestCancelled,
    RequestFailed,
    RequestMigrated,
    RequestPrepared,
    RequestRejected,
    RequestRouted,
    RouteDecision,
    WorkStopped,
)
from schemas.subjects import PREFIX, REQUESTS, ConsumerSpec
from services.mesh.bus import Bus
from services.mesh.consumer import Consumer, Delivery

log = logging.getLogger(__name__)

DIR_ENV = "RIPPLEMESH_LIFECYCLE_DIR"
PREPARED_ENV = "RIPPLEMESH_LIFECYCLE_PREPARED"
DEFAULT_DIR = "lifecycle"
STATE_FILE = "_state.msgpack"  # a leading "_" or ".": not read as data by pyarrow or a part-*.parquet glob
MOONCAKE_BLOCK_TOKENS = 512  # what one of a Mooncake trace's hash ids covers (the simulator's loader)

ROWS = Counter("ripplemesh_example_lifecycle_rows_total", "Request rows the lifecycle exporter wrote.")
DROPPED = Counter(
    "ripplemesh_example_lifecycle_dropped_total",
    "Requests the lifecycle exporter gave up on (no end within its timeout, or too many in flight).",
)

# One row per request. Nullable where an event may be missing (a request rejected at ingress has
# no RequestPrepared; one that failed never decoded).
SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("tenant", pa.string()),
        ("model", pa.string()),
        ("workflow_id", pa.string()),
        ("workflow_step", pa.int32()),
        ("workflow_steps", pa.int32()),
        ("priority", pa.string()),
        ("submitted_at", pa.float64()),  # seconds since the epoch, as ingress stamped it
        ("first_event_at", pa.float64()),  # the earliest event seen (submitted_at's stand-in)
        ("ended_at", pa.float64()),  # the end event's occurred_at
        ("deadline_at", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("max_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        ("mode", pa.string()),  # aggregated, disaggregated
        ("prefill_worker", pa.string()),
        ("prefill_gpu", pa.string()),
        ("decode_worker", pa.string()),
        ("decode_gpu", pa.string()),
        ("admission_wait_s", pa.float64()),
        ("route_policy", pa.string()),
        ("predicted_ttft_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("latency_s", pa.float64()),
        ("gpu_seconds", pa.float64()),
        ("kv_transfer_bytes", pa.int64()),
        ("status", pa.string()),  # completed, failed, rejected, cancelled
        ("stage", pa.string()),  # where it failed or was rejected
        ("reason", pa.string()),  # a rejection's or a cancellation's reason
        ("message", pa.string()),
        ("migrations", pa.int32()),
        ("events", pa.int32()),  # distinct events folded into the row
        ("block_size", pa.int32()),
        ("block_hashes", pa.list_(pa.int64())),  # the prompt's chained hashes, one per full block
    ]
)
COLUMNS = tuple(SCHEMA.names)

LIFECYCLE_TYPES = (
    AdmissionDecision,
    RouteDecision,
    RequestRouted,
    PrefillCompleted,
    DecodeCompleted,
    RequestFailed,
    RequestRejected,
    RequestCancelled,
    RequestMigrated,
    WorkStopped,
)


class RequestState(msgspec.Struct, kw_only=True):
    """A request's row as folded so far, with what the fold needs beside it."""

    request_id: str
    tenant: str
    model: str | None = None
    workflow_id: str | None = None
    workflow_step: int | None = None
    workflow_steps: int | None = None
    priority: str | None = None
    submitted_at: float | None = None
    first_event_at: float | None = None
    ended_at: float | None = None
    deadline_at: float | None = None
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    mode: str | None = None
    prefill_worker: str | None = None
    prefill_gpu: str | None = None
    decode_worker: str | None = None
    decode_gpu: str | None = None
    admission_wait_s: float | None = None
    route_policy: str | None = None
    predicted_ttft_s: float | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    gpu_seconds: float = 0.0
    kv_transfer_bytes: int = 0
    status: str | None = None
    stage: str | None = None
    reason: str | None = None
    message: str | None = None
    migrations: int = 0
    events: int = 0
    block_size: int | None = None
    block_hashes: list[int] | None = None
    # Not columns: the event ids folded in (idempotency), and when (on the exporter's clock) the
    # request was first seen and ended.
    event_ids: set[str] = msgspec.field(default_factory=set)
    seen_at: float = 0.0
    closed_at: float | None = None

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COLUMNS}


class SavedState(msgspec.Struct, kw_only=True):
    requests: list[RequestState]
    written: list[str]
    dropped: int = 0


def _workflow(state: RequestState, workflow_id: str | None, step: int | None, steps: int | None) -> None:
    state.workflow_id = state.workflow_id or workflow_id
    state.workflow_step = state.workflow_step or step
    state.workflow_steps = state.workflow_steps or steps


class LifecycleFold:
    """Each request's events into its row; no I/O, so a test drives it with its own clock."""

    def __init__(
        self,
        *,
        settle_s: float = 2.0,
        request_timeout_s: float = 900.0,
        max_in_flight: int = 200_000,
        max_written: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settle_s = settle_s
        self.request_timeout_s = request_timeout_s
        self.max_in_flight = max_in_flight
        self.max_written = max_written
        self.clock = clock
        self.open: dict[str, RequestState] = {}  # not ended, by first sight
        self.closing: dict[str, RequestState] = {}  # ended, settling, by end
        self.ready: list[RequestState] = []  # settled: the next batch
        self.written: OrderedDict[str, None] = OrderedDict()  # handed out (bounded)
        self.dropped = 0
        self.late = 0
        self.duplicates = 0

    def _state(self, request_id: str, tenant: str, occurred_at: float) -> RequestState | None:
        if request_id in self.written:
            self.late += 1
            return None
        state = self.open.get(request_id) or self.closing.get(request_id)
        if state is None:
            state = RequestState(request_id=request_id, tenant=tenant, seen_at=self.clock())
            self.open[request_id] = state
            while len(self.open) > self.max_in_flight:
                self._drop(next(iter(self.open)))
        if state.first_event_at is None or occurred_at < state.first_event_at:
            state.first_event_at = occurred_at
        return state

    def _drop(self, request_id: str) -> None:
        del self.open[request_id]
        self.dropped += 1
        DROPPED.inc()

    def _end(self, state: RequestState, status: str, occurred_at: float) -> None:
        if state.status is not None:  # the first end stands
            return
        state.status = status
        state.ended_at = occurred_at
        state.closed_at = self.clock()
        self.open.pop(state.request_id, None)
        self.closing[state.request_id] = state

    def prepared(self, event: RequestPrepared) -> None:
        request = event.request
        state = self._state(request.request_id, request.tenant, event.occurred_at)
        if state is None or not self._first(state, event.event_id):
            return
        state.model = request.model
        state.priority = request.priority
        state.submitted_at = request.submitted_at
        state.deadline_at = request.deadline_at
        state.prompt_tokens = len(request.prompt_tokens)
        state.max_tokens = request.max_tokens
        state.block_size = request.block_size
        state.block_hashes = list(request.block_hashes)
        if request.workflow is not None:
            workflow = request.workflow
            state.workflow_id, state.workflow_step = workflow.workflow_id, workflow.step
            state.workflow_steps = workflow.steps

    def _first(self, state: RequestState, event_id: str) -> bool:
        if event_id in state.event_ids:
            self.duplicates += 1
            return False
        state.event_ids.add(event_id)
        state.events += 1
        return True

    def apply(self, event: Any) -> None:
        state = self._state(event.request_id, event.tenant, event.occurred_at)
        if state is None or not self._first(state, event.event_id):
            return
        match event:
            case AdmissionDecision():
                state.priority = state.priority or event.priority
                if event.outcome == "admitted":
                    state.admission_wait_s = event.waited_s
                _workflow(state, event.workflow_id, event.workflow_step, None)
            case RouteDecision():
                state.priority = state.priority or event.priority
                state.route_policy = state.route_policy or event.policy
                if event.chosen is not None and state.predicted_ttft_s is None:
                    state.predicted_ttft_s = event.chosen.ttft_s
                if state.prompt_tokens is None and event.prompt_tokens:
                    state.prompt_tokens = event.prompt_tokens
                _workflow(state, event.workflow_id, event.workflow_step, event.workflow_steps)
            case RequestRouted():  # a later placement (after a migration) replaces an earlier one
                state.mode = event.mode
                state.prefill_worker, state.decode_worker = event.prefill_worker, event.decode_worker
            case PrefillCompleted():
                state.prefill_worker, state.prefill_gpu = event.worker_id, event.gpu_type
                state.prompt_tokens = state.prompt_tokens or event.prompt_tokens
                state.cached_tokens = event.cached_tokens
                if state.ttft_s is None:  # the first token the client saw
                    state.ttft_s = event.ttft_s
                state.gpu_seconds += event.gpu_seconds
                _workflow(state, event.workflow_id, None, None)
            case DecodeCompleted():
                state.decode_worker, state.decode_gpu = event.worker_id, event.gpu_type
                state.output_tokens = event.usage.completion_tokens
                state.prompt_tokens = state.prompt_tokens or event.usage.prompt_tokens
                if state.cached_tokens is None:
                    state.cached_tokens = event.usage.cached_tokens
                state.finish_reason = event.finish_reason
                state.latency_s = event.latency_s
                state.gpu_seconds += event.gpu_seconds
                state.kv_transfer_bytes += event.kv_transfer_bytes
                state.deadline_at = state.deadline_at or event.deadline_at
                _workflow(state, event.workflow_id, event.workflow_step, event.workflow_steps)
                self._end(state, "completed", event.occurred_at)
            case RequestFailed():
                if state.status is None:
                    state.stage, state.message = event.stage, event.message
                _workflow(state, event.workflow_id, event.workflow_step, event.workflow_steps)
                self._end(state, "failed", event.occurred_at)
            case RequestRejected():
                if state.status is None:
                    state.stage, state.reason, state.message = event.stage, event.reason, event.message
                state.deadline_at = state.deadline_at or event.deadline_at
                _workflow(state, event.workflow_id, event.workflow_step, event.workflow_steps)
                self._end(state, "rejected", event.occurred_at)
            case RequestCancelled():
                if state.status is None:
                    state.reason = event.reason
                _workflow(state, event.workflow_id, event.workflow_step, event.workflow_steps)
                self._end(state, "cancelled", event.occurred_at)
            case RequestMigrated():  # its number, not a count of events: a replay counts once
                state.migrations = max(state.migrations, event.migration)
            case WorkStopped():
                state.gpu_seconds += event.gpu_seconds

    def sweep(self) -> None:
        """Settled requests to `ready`; those open past their timeout dropped."""
        now = self.clock()
        while self.closing:
            state = next(iter(self.closing.values()))
            if state.closed_at is not None and now - state.closed_at < self.settle_s:
                break
            self._settle(state)
        while self.open:
            request_id, state = next(iter(self.open.items()))
            if now - state.seen_at < self.request_timeout_s:
                break
            self._drop(request_id)

    def _settle(self, state: RequestState) -> None:
        del self.closing[state.request_id]
        self.ready.append(state)
        self.written[state.request_id] = None
        while len(self.written) > self.max_written:
            self.written.popitem(last=False)

    def take(self, *, everything: bool = False) -> list[dict[str, Any]]:
        """The rows ready to write (with `everything`, the settling ones too), handed out once."""
        if everything:
            for state in list(self.closing.values()):
                self._settle(state)
        rows = [state.row() for state in self.ready]
        self.ready = []
        return rows

    def save(self) -> SavedState:
        return SavedState(
            requests=[*self.open.values(), *self.closing.values()],
            written=list(self.written),
            dropped=self.dropped,
        )

    def restore(self, saved: SavedState) -> None:
        now = self.clock()
        for request_id in saved.written:
            self.written[request_id] = None
        for state in saved.requests:
            state.seen_at = now  # its timeout starts again
            if state.status is None:
                self.open[state.request_id] = state
            else:
                state.closed_at = now
                self.closing[state.request_id] = state
        self.dropped += saved.dropped


class PartWriter:
    """``part-<n>.parquet`` files in `directory`, numbered on from those already there."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        parts = (re.fullmatch(r"part-(\d+)\.parquet", path.name) for path in directory.iterdir())
        numbers = [int(part.group(1)) for part in parts if part]
        self.next = max(numbers, default=-1) + 1
        self.rows_written = 0

    def write(self, rows: list[dict[str, Any]]) -> Path:
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        path = self.directory / f"part-{self.next:06d}.parquet"
        partial = self.directory / f".{path.name}.partial"
        pq.write_table(table, partial, compression="zstd")
        os.replace(partial, path)  # whole or not at all, for a reader of the directory
        self.next += 1
        self.rows_written += len(rows)
        ROWS.inc(len(rows))
        return path


@dataclass
class LifecycleExporter(Subscriber):
    """A Subscriber on the lifecycle events with a second consumer on ``rmesh.prepared.*``."""

    out_dir: Path | None = None  # default: $RIPPLEMESH_LIFECYCLE_DIR, else ./lifecycle
    flush_rows: int = 1000
    flush_every_s: float = 5.0
    settle_s: float = 2.0
    request_timeout_s: float = 900.0
    max_in_flight: int = 200_000
    # The second consumer, on REQUESTS (prompt lengths, block hashes, model, max_tokens,
    # submitted_at); the subscribers' NATS user may not read it. Default: $RIPPLEMESH_LIFECYCLE_PREPARED
    # ("0": off), else on.
    read_prepared: bool | None = None
    fold: LifecycleFold = field(init=False)
    writer: PartWriter | None = field(default=None, init=False)
    prepared_consumer: Consumer[RequestPrepared] | None = field(default=None, init=False)
    _flusher: asyncio.Task[None] | None = field(default=None, init=False)
    _wake: asyncio.Event | None = field(default=None, init=False)
    _stopping: bool = field(default=False, init=False)
    _unwritten: int = field(default=0, init=False)  # the first row of the batch being written

    def __post_init__(self) -> None:
        self.fold = LifecycleFold(
            settle_s=self.settle_s, request_timeout_s=self.request_timeout_s, max_in_flight=self.max_in_flight
        )
        self.on(*LIFECYCLE_TYPES)(self.lifecycle_event)

    def directory(self) -> Path:
        return self.out_dir if self.out_dir is not None else Path(os.environ.get(DIR_ENV, DEFAULT_DIR))

    def reads_prepared(self) -> bool:
        if self.read_prepared is not None:
            return self.read_prepared
        return os.environ.get(PREPARED_ENV, "1") != "0"

    def prepared_spec(self) -> ConsumerSpec:
        """The subscriber's own consumer, moved to REQUESTS's ``rmesh.prepared.*``."""
        spec = self.spec()
        return msgspec.structs.replace(
            spec,
            durable=f"{spec.durable}-prepared",
            stream=REQUESTS.name,
            filter_subject=f"{PREFIX}.prepared.*",
        )

    async def lifecycle_event(self, event: Any, context: Context) -> None:
        self.fold.apply(event)
        self._poke()

    async def _prepared(self, event: RequestPrepared, delivery: Delivery) -> None:
        self.fold.prepared(event)

    def _poke(self) -> None:
        if len(self.fold.ready) >= self.flush_rows and self._wake is not None:
            self._wake.set()

    async def start(self, bus: Bus) -> None:
        self.writer = PartWriter(self.directory())
        if self.durable:  # what a stop left in flight, taken up once
            saved = await asyncio.to_thread(_take_state, self.writer.directory / STATE_FILE)
            if saved is not None:
                self.fold.restore(saved)
        self._stopping = False
        self._wake = asyncio.Event()
        self._flusher = asyncio.create_task(self._flush_loop(), name=f"flush-{self.name}")
        try:
            if self.reads_prepared():
                consumer: Consumer[RequestPrepared] = Consumer(
                    bus, self.prepared_spec(), RequestPrepared, self._prepared, max_inflight=self.max_inflight
                )
                try:
                    await consumer.start()
                except Exception as exc:
                    raise RuntimeError(
                        f"{self.name}: no consumer on {REQUESTS.name} ({exc!r}): run it as the services' "
                        f"NATS user, or with {PREPARED_ENV}=0 (rows without prompts' block hashes)"
                    ) from exc
                self.prepared_consumer = consumer
            await super().start(bus)
        except BaseException:
            await self.stop()
            raise

    async def stop(self, grace_s: float = 10.0) -> None:
        await super().stop(grace_s)
        if self.prepared_consumer is not None:
            await self.prepared_consumer.stop(grace_s)
            self.prepared_consumer = None
        if self._flusher is not None:
            self._stopping = True
            assert self._wake is not None
            self._wake.set()
            await self._flusher
            self._flusher = None
        if self.writer is None:
            return
        await self._write(self.fold.take(everything=True))
        if self.durable and (self.fold.open or self.fold.written):
            await asyncio.to_thread(_put_state, self.writer.directory / STATE_FILE, self.fold.save())
        elif self.fold.open:
            self.fold.dropped += len(self.fold.open)
            DROPPED.inc(len(self.fold.open))
            self.fold.open.clear()
        log.info(
            "lifecycle export stopped",
            extra={
                "rows": self.writer.rows_written,
                "in_flight": len(self.fold.open),
                "dropped": self.fold.dropped,
                "late": self.fold.late,
            },
        )

    async def _flush_loop(self) -> None:
        assert self._wake is not None and self.writer is not None
        last = time.monotonic()
        tick = max(0.05, min(0.5, self.flush_every_s, self.settle_s or 0.5))
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            self._wake.clear()
            self.fold.sweep()
            due = time.monotonic() - last >= self.flush_every_s
            if self.fold.ready and (due or len(self.fold.ready) >= self.flush_rows):
                rows = self.fold.take()
                try:
                    await self._write(rows)
                except Exception:  # the disk is full, say: the rows wait for the next try
                    log.exception("lifecycle export: a batch could not be written")
                    self.fold.ready[:0] = [RequestState(**row) for row in rows[self._unwritten :]]
                last = time.monotonic()

    async def _write(self, rows: list[dict[str, Any]]) -> None:
        """In files of `flush_rows` rows at most, off the event loop."""
        assert self.writer is not None
        for start in range(0, len(rows), self.flush_rows):
            self._unwritten = start
            await asyncio.to_thread(self.writer.write, rows[start : start + self.flush_rows])
        self._unwritten = 0


def _take_state(path: Path) -> SavedState | None:
    if not path.exists():
        return None
    saved = msgspec.msgpack.decode(path.read_bytes(), type=SavedState)
    path.unlink()  # a crash later must not bring these back a second time
    return saved


def _put_state(path: Path, saved: SavedState) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(msgspec.msgpack.encode(saved))
    os.replace(partial, path)


exporter = LifecycleExporter("lifecycle-export")


# ------------------------------------------------------------------ replay in the simulator


def _workflow_fields(row: dict[str, Any], arrival: float, start: float) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, name in (("tenant", "tenant"), ("priority", "priority"), ("workflow_id", "workflow_id")):
        if row[key] is not None:
            fields[name] = row[key]
    if row["workflow_id"] is not None and row["workflow_step"] is not None:
        fields["step"] = int(row["workflow_step"])
        if row["workflow_steps"] is not None:
            fields["steps"] = int(row["workflow_steps"])
    if row["deadline_at"] is not None:
        fields["e2e_deadline_ms"] = max(1, round((row["deadline_at"] - arrival) * 1000))
    if row["status"] == "completed" and row["ended_at"] is not None:
        fields["completed_ms"] = round((row["ended_at"] - start) * 1000)
    return fields


class MooncakeExport(NamedTuple):
    written: int  # trace lines
    skipped: int  # rows left out: no prompt length, no arrival time, or a status not asked for
    blocks: int  # distinct hash ids


def to_mooncake_jsonl(
    parquet_dir: str | Path,
    out_path: str | Path,
    block_size: int | None = None,
    *,
    statuses: Collection[str] | None = None,
) -> MooncakeExport:
    """`to_workflow_jsonl` with the Mooncake fields alone."""
    return to_workflow_jsonl(parquet_dir, out_path, block_size, statuses=statuses, workflows=False)


def to_workflow_jsonl(
    parquet_dir: str | Path,
    out_path: str | Path,
    block_size: int | None = None,
    *,
    statuses: Collection[str] | None = None,
    workflows: bool = True,
) -> MooncakeExport:
    """The exported requests as a Mooncake trace (FAST'25's JSONL), in arrival order: `timestamp`
    (ms from the first arrival), `input_length`, `output_length` and `hash_ids`, one id per
    512-token block (what the simulator's loader reads one id as), numbered 0, 1, ... in order of
    first appearance, as Mooncake's own traces are.

    `block_size` is the tokens each exported hash covers (default: each row's own, the mesh's
    block size); it must divide 512. A 512-token block is identified by the chained hash of its
    last mesh block, so two prompts share a hash id exactly when they share that whole prefix;
    the part of a prompt past its last full block gets an id of its own. The output length is
    what a completed request generated and what the others asked for (`max_tokens`): a rejected
    or failed request still offered its load. `statuses` keeps only those rows (default: all).

    With `workflows`, each line also carries what the simulator's workflow trace format reads
    (docs/simulator.md) where the row has it: `tenant`, `priority`, `workflow_id`, `step`,
    `steps`, `e2e_deadline_ms` (the mesh's deadline is on the whole request, from its arrival)
    and `completed_ms` (when a completed request ended, ms from the first arrival), so a closed-
    loop replay issues a step its recorded think time after the previous one completes.
    """
    table = pq.read_table(
        parquet_dir,
        columns=[
            "tenant",
            "priority",
            "workflow_id",
            "workflow_step",
            "workflow_steps",
            "deadline_at",
            "ended_at",
            "submitted_at",
            "first_event_at",
            "prompt_tokens",
            "max_tokens",
            "output_tokens",
            "status",
            "block_size",
            "block_hashes",
        ],
    )
    rows = table.to_pylist()
    ids: dict[int, int] = {}
    fresh = 0

    def new_id() -> int:
        nonlocal fresh
        fresh += 1
        return fresh - 1

    kept: list[tuple[float, dict[str, Any]]] = []
    for row in rows:
        arrival = row["submitted_at"] if row["submitted_at"] is not None else row["first_event_at"]
        if arrival is None or not row["prompt_tokens"]:
            continue
        if statuses is not None and row["status"] not in statuses:
            continue
        output = row["output_tokens"] if row["status"] == "completed" else None
        if output is None:
            output = row["max_tokens"]
        if output is None:
            continue
        kept.append((arrival, {**row, "output_length": output}))
    kept.sort(key=lambda item: item[0])
    start = kept[0][0] if kept else 0.0
    with Path(out_path).open("w") as out:
        for arrival, row in kept:
            prompt = int(row["prompt_tokens"])
            hashes: list[int] = row["block_hashes"] or []
            size = block_size or row["block_size"] or MOONCAKE_BLOCK_TOKENS
            if MOONCAKE_BLOCK_TOKENS % size:
                raise ValueError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS}, got {size}")
            per = MOONCAKE_BLOCK_TOKENS // size
            hash_ids = []
            for first in range(0, len(hashes), per):
                key = hashes[min(first + per, len(hashes)) - 1]
                if key not in ids:
                    ids[key] = new_id()
                hash_ids.append(ids[key])
            while len(hash_ids) < math.ceil(prompt / MOONCAKE_BLOCK_TOKENS):
                hash_ids.append(new_id())  # tokens past the last full block: no one shares them
            line = {
                "timestamp": round((arrival - start) * 1000),
                "input_length": prompt,
                "output_length": int(row["output_length"]),
                "hash_ids": hash_ids,
            }
            if workflows:
                line.update(_workflow_fields(row, arrival, start))
            out.write(json.dumps(line) + "\n")
    return MooncakeExport(written=len(kept), skipped=len(rows) - len(kept), blocks=fresh)
