"""The batch runner: runs the Batch API's batches (stored by ingress, `services/ingress/batch_api.py`)
through the mesh's own request path, as the lowest work there is.

Every `TICK_S` it reads the active batches (BATCHES), and for each:

- ``validating``: reads the input file, records each malformed line at once as an error line
  (its line number in the message), and moves the batch to ``in_progress`` (``failed`` when the
  file is gone or holds no line);
- ``in_progress``: lines wait in its queue; `policy.release` says how many the fleet can take
  now (its spare capacity, paused under interactive pressure), and each is submitted with
  `MeshClient` over NATS (``rmesh.req.<tenant>``, so ingress prepares it as any request) as
  service class ``batch``, which ingress runs as ``sheddable`` at the lowest priority level.
  A line refused for capacity or quota (or lost with its worker, or timed out) goes back to the
  queue; any other refusal is its error line. Each finished line is recorded once
  (BATCH_LINES); a restarted runner loads them and runs only the rest;
- ``cancelling`` (a client's cancel) and past ``expires_at``: lines in flight are cancelled, no
  more are sent; then ``cancelled`` / ``expired`` with the files of what finished;
- once every line is recorded: ``finalizing``, the output and error files written, ``completed``.

On shutdown it sends nothing more and lets the lines in flight finish (up to `STOP_GRACE_S`),
so a restart runs no line twice; a line still running then is cancelled and runs again. Killed
outright, it leaves lines running in the mesh: each line's request id is put in BATCH_SENT
before it is submitted, and a restarted runner reads those lines' answers back from the TOKENS
stream (waiting while one is still streaming) instead of running them again; only a line whose
stream ended without an answer, or fell silent, is submitted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from opentelemetry import trace
from prometheus_client import Counter, Gauge
from starlette.routing import BaseRoute

from ripplemesh.client import Completion, MeshClient, MeshError, MeshUnavailable, completion_of
from schemas.events import (
    AdmissionDecision,
    RequestRejected,
    StreamFailed,
    StreamFinished,
    WorkerState,
    decode_event,
)
from schemas.subjects import WORKERS, event_subject, tokens_subject
from services.batch import policy
from services.batch.records import (
    ACTIVE,
    MAX_LINES,
    TERMINAL,
    BatchRecord,
    FileRecord,
    LineRequest,
    LineResult,
    MalformedLine,
    RequestCounts,
    failure_line,
    jsonl,
    new_id,
    parse_line,
    split_lines,
    success_line,
)
from services.batch.records import LineError as BatchLineError
from services.batch.store import BATCHES, BatchStore
from services.ingress.fleet import FleetView
from services.ingress.openai_api import ResponseShape
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.runtime import Runtime
from services.mesh.token_stream import StreamTimeout, stored_events

log = logging.getLogger(__name__)
tracer = trace.get_tracer("ripplemesh.batch")

TICK_S = 0.25
SAVE_EVERY_S = 0.5
STOP_GRACE_S = 8.0
# Refusals that mean "not now": the line is sent again later.
RETRY_STATUSES = frozenset({429, 503, 504})

LINES = Counter("ripplemesh_batch_lines_total", "Batch lines finished, by outcome.", ["outcome"])
RELEASES = Counter("ripplemesh_batch_release_decisions_total", "Release decisions, by reason.", ["reason"])
IN_FLIGHT = Gauge("ripplemesh_batch_lines_in_flight", "Batch lines submitted and not finished.")


@dataclass
class Job:
    """A batch the runner works on: its record as last read, its lines, what finished."""

    record: BatchRecord
    pending: deque[LineRequest] = field(default_factory=deque)
    in_flight: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    done: dict[int, LineResult] = field(default_factory=dict)
    total: int = 0
    dirty: bool = False
    saved_at: float = 0.0

    def counts(self) -> RequestCounts:
        ok = sum(1 for r in self.done.values() if r.ok)
        return RequestCounts(total=self.total, completed=ok, failed=len(self.done) - ok)


class BatchService:
    name: ClassVar[str] = "batch"
    background = True  # off the request path: the request path gets the CPU first

    def __init__(self, limits: policy.BatchLimits | None = None) -> None:
        # Given here (a test), or the mesh config's `[batch]` when the service starts.
        self._given_limits = limits
        self.limits = limits or policy.BatchLimits()
        self.runtime: Runtime | None = None
        self.store: BatchStore | None = None
        self.fleet = FleetView()
        self.jobs: dict[str, Job] = {}
        # Every batch as the BATCHES watch last saw it, and those this process finished.
        self.seen: dict[str, BatchRecord] = {}
        self.finished: set[str] = set()
        self.own_requests: set[str] = set()
        self.last_pressure_at: float | None = None
        self.last_pushback_at: float | None = None
        self.last_release: policy.Release | None = None
        self.stopping = False
        self._subscriptions: list[Any] = []

    # ------------------------------------------------------------ lifecycle

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.limits = self._given_limits or runtime.config.batch.limits()
        self.store = BatchStore(runtime.bus)
        nc = runtime.bus.nc
        self._subscriptions = [
            await nc.subscribe(event_subject("admission"), cb=self._on_pressure_event),
            await nc.subscribe(event_subject("rejected"), cb=self._on_pressure_event),
        ]
        runtime.spawn(self._watch_workers(), "batch-workers-watch")
        runtime.spawn(self._watch_batches(), "batch-batches-watch")
        runtime.spawn(runtime.every(TICK_S, self.tick, "batch-tick"), "batch-tick")

    async def stop(self) -> None:
        self.stopping = True
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        tasks = [t for job in self.jobs.values() for t in job.in_flight.values()]
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=2.0)
        for job in self.jobs.values():
            with contextlib.suppress(Exception):
                await self._save_counts(job, force=True)

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        release = self.last_release
        return {
            "batches_active": len(self.jobs),
            "lines_pending": sum(len(j.pending) for j in self.jobs.values()),
            "lines_in_flight": sum(len(j.in_flight) for j in self.jobs.values()),
            "last_release": None if release is None else {"count": release.count, "reason": release.reason},
            "limits": dataclasses.asdict(self.limits),
        }

    @property
    def _rt(self) -> Runtime:
        if self.runtime is None:
            raise RuntimeError("batch runner not started")
        return self.runtime

    @property
    def _store(self) -> BatchStore:
        if self.store is None:
            raise RuntimeError("batch runner not started")
        return self.store

    async def _watch_workers(self) -> None:
        watch = HeartbeatWatch(await self._rt.bus.key_value(WORKERS))
        async for entry in watch.updates():
            self.fleet.observe(entry.key, entry.value, entry.operation)

    async def _watch_batches(self) -> None:
        """The BATCHES bucket: new batches and cancels, as they are written (nothing is polled
        while no batch runs). A quiet bucket is normal: the watch is checked every 30 s."""
        watch = HeartbeatWatch(await self._rt.bus.key_value(BATCHES), silent_after_s=30.0)
        async for entry in watch.updates():
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self.seen.pop(entry.key, None)
                continue
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                self.seen[entry.key] = msgspec.json.decode(entry.value, type=BatchRecord)

    async def _on_pressure_event(self, msg: Any) -> None:
        """Interactive work admission held back (deferred, or refused for capacity) is pressure;
        one of the batch's own lines so treated is pushback."""
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if isinstance(event, AdmissionDecision):
            own = event.request_id in self.own_requests
            held = event.outcome == "deferred"
        elif isinstance(event, RequestRejected):
            own = event.request_id in self.own_requests
            # Another tenant over its own quota is no pressure on the fleet; a line of the batch
            # refused for either backs off.
            held = event.reason == "capacity" or (own and event.reason == "quota")
        else:
            return
        if held and own:
            self.last_pushback_at = time.time()
        elif held:
            self.last_pressure_at = time.time()

    # ------------------------------------------------------------ the loop

    async def tick(self) -> None:
        if self.stopping:
            return
        now = time.time()
        for batch_id, seen in list(self.seen.items()):
            if seen.status not in ACTIVE or batch_id in self.finished:
                continue
            job = self.jobs.get(batch_id)
            if job is None:
                # Taken up as it stands now (the watch may lag behind the runner's own writes).
                record = await self._store.batch(batch_id)
                if record is not None and record.status in ACTIVE:
                    job = self.jobs[batch_id] = Job(record)
                    try:
                        await self._load(job)
                    except Exception:
                        del self.jobs[batch_id]  # taken up again at the next tick
                        raise
            elif seen.status == "cancelling" and job.record.status in ("validating", "in_progress"):
                job.record = seen  # the client's cancel; the runner's own changes it knows
        for batch_id, job in list(self.jobs.items()):
            if self.stopping:
                return
            await self._advance(job, now)
            if job.record.status in TERMINAL:
                del self.jobs[batch_id]
                self.finished.add(batch_id)
        if self.jobs:
            self._release(now)
        IN_FLIGHT.set(sum(len(j.in_flight) for j in self.jobs.values()))
        for job in self.jobs.values():
            await self._save_counts(job)

    async def _load(self, job: Job) -> None:
        """A batch taken up (new, or after a restart): its lines, less those already recorded."""
        record = job.record
        content = await self._store.content(record.input_file_id)
        if content is None:
            await self._fail(job, "input_file_missing", f"the input file {record.input_file_id} is gone")
            return
        lines = split_lines(content)
        job.total = len(lines)
        if not lines:
            await self._fail(job, "empty_file", "the input file holds no line")
            return
        if len(lines) > MAX_LINES:
            await self._fail(
                job, "too_many_lines", f"the input file has {len(lines)} lines; at most {MAX_LINES}"
            )
            return
        job.done = await self._store.lines(record.id)
        sent = await self._store.sent(record.id)
        malformed: list[BatchLineError] = []
        for number, raw in lines:
            try:
                request = parse_line(number, raw, record.endpoint)
            except MalformedLine as exc:
                malformed.append(
                    BatchLineError(code="invalid_line", message=exc.message, line=number, param=exc.param)
                )
                if number not in job.done:
                    result = LineResult(
                        line=number,
                        ok=False,
                        output=failure_line(
                            record.id,
                            number,
                            exc.custom_id,
                            code="invalid_line",
                            message=exc.message,
                            param=exc.param,
                        ),
                    )
                    await self._record(job, result, "malformed")
                continue
            if number in job.done:
                continue
            if number in sent and record.status == "in_progress":
                # In the mesh when a runner before this one died: its answer, not a new run.
                task = self._rt.spawn(
                    self._run_line(job, request, sent[number]), f"batch-line-{record.id}-{number}"
                )
                job.in_flight[number] = task
            else:
                job.pending.append(request)
        if record.status == "validating":
            now = int(time.time())

            def begin(r: BatchRecord) -> BatchRecord | None:
                if r.status != "validating":
                    return None
                return msgspec.structs.replace(
                    r, status="in_progress", in_progress_at=now, errors=malformed, request_counts=job.counts()
                )

            job.record = await self._store.modify(record.id, begin) or record
        log.info(
            "batch taken up",
            extra={
                "batch_id": record.id,
                "lines": job.total,
                "done": len(job.done),
                "pending": len(job.pending),
                "answers_to_read_back": len(job.in_flight),
            },
        )

    async def _advance(self, job: Job, now: float) -> None:
        status = job.record.status
        if status == "cancelling":
            await self._wind_down(job, "cancelled")
        elif status == "in_progress" and policy.expired(job.record.expires_at, now):
            await self._wind_down(job, "expired")
        elif status == "finalizing" or (status == "in_progress" and not job.pending and not job.in_flight):
            await self._finalize(job, "completed")

    async def _wind_down(self, job: Job, final: str) -> None:
        job.pending.clear()
        for task in job.in_flight.values():
            task.cancel()
        if job.in_flight:
            await asyncio.wait(list(job.in_flight.values()), timeout=5.0)
        if not job.in_flight:
            await self._finalize(job, final)

    def _release(self, now: float) -> None:
        """Submit as many lines as the policy says, oldest batch first."""
        jobs = sorted(
            (j for j in self.jobs.values() if j.record.status == "in_progress" and j.pending),
            key=lambda j: (j.record.created_at, j.record.id),
        )
        in_flight = sum(len(j.in_flight) for j in self.jobs.values())
        workers = [policy.WorkerLoad.of(w) for w in self._decode_workers(now)]
        state = policy.RunnerState(
            pending=sum(len(j.pending) for j in jobs),
            in_flight=in_flight,
            last_pressure_at=self.last_pressure_at,
            last_pushback_at=self.last_pushback_at,
        )
        decision = policy.release(workers, state, self.limits, now)
        self.last_release = decision
        RELEASES.labels(decision.reason).inc()
        left = decision.count
        for job in jobs:
            while left > 0 and job.pending:
                line = job.pending.popleft()
                task = self._rt.spawn(self._run_line(job, line), f"batch-line-{job.record.id}-{line.line}")
                job.in_flight[line.line] = task
                left -= 1

    def _decode_workers(self, now: float) -> list[WorkerState]:
        return [w for w in self.fleet.live(now) if w.role == "decode"]

    # ------------------------------------------------------------ one line

    async def _sent_answer(self, tenant: str, request_id: str, tool_calls: bool) -> Completion | None:
        """A line submitted before a restart: its answer read back from the TOKENS stream once
        its final event is there (waiting while tokens still come), or None: failed, or no new
        token for the stream idle timeout."""
        subject = tokens_subject(tenant, request_id)
        idle_s = self._rt.config.stream_idle_timeout_s
        quiet_since, seen = time.monotonic(), -1
        while not self.stopping:
            try:
                events = await stored_events(self._rt.bus.nc, subject)
            except TimeoutError:
                events = []
            by_seq = {event.seq: event for event in events}
            ordered = [by_seq[seq] for seq in sorted(by_seq)]
            if any(isinstance(e, StreamFailed) for e in ordered):
                return None
            if any(isinstance(e, StreamFinished) for e in ordered):
                return completion_of(ordered, tool_calls=tool_calls)
            if len(ordered) != seen:
                quiet_since, seen = time.monotonic(), len(ordered)
            elif time.monotonic() - quiet_since > idle_s:
                return None
            await asyncio.sleep(0.5)
        return None

    async def _run_line(self, job: Job, line: LineRequest, sent_as: str | None = None) -> None:
        record = job.record
        tool_calls = bool(line.tools) and line.tool_choice != "none"
        completion: Completion | None = None
        if sent_as is not None:
            with contextlib.suppress(MeshError, RuntimeError):
                completion = await self._sent_answer(record.tenant, sent_as, tool_calls)
        request_id = f"{record.id}-{line.line}-{secrets.token_hex(3)}"
        if sent_as is not None and completion is not None:
            request_id = sent_as
        self.own_requests.add(request_id)
        client = MeshClient("", record.tenant, model=line.model, nc=self._rt.bus.nc)
        result: LineResult | None = None
        try:
            if completion is None:
                await self._store.mark_sent(record.id, line.line, request_id)
            with tracer.start_as_current_span(
                "batch.line", attributes={"ripple.batch_id": record.id, "ripple.batch_line": line.line}
            ):
                completion = completion or await client.complete(
                    request_id=request_id,
                    model=line.model,
                    prompt=line.prompt,
                    messages=line.messages,
                    max_tokens=line.max_tokens,
                    temperature=line.temperature,
                    tools=line.tools,
                    tool_choice=line.tool_choice,
                    response_format=line.response_format,
                    logprobs=line.logprobs,
                    priority="sheddable",
                    priority_level=self._rt.config.admission.min_priority_level,
                    service_class="batch",
                )
            shape = ResponseShape(
                line.api,
                request_id,
                line.model,
                tool_calls=tool_calls,
                top_logprobs=line.logprobs,
            )
            body = shape.response(
                [shape.choice(completion.text, completion.logprobs, completion.finish_reason)],
                completion.usage,
            )
            result = LineResult(
                line=line.line,
                ok=True,
                output=success_line(record.id, line.line, line.custom_id, request_id, body),
            )
        except MeshError as exc:
            if exc.http_status in RETRY_STATUSES:
                self._again(job, line)
                return
            result = LineResult(
                line=line.line,
                ok=False,
                output=failure_line(
                    record.id,
                    line.line,
                    line.custom_id,
                    code=exc.code,
                    message=f"line {line.line}: {exc.message}",
                    status_code=exc.http_status,
                    request_id=request_id,
                ),
            )
        except (MeshUnavailable, StreamTimeout) as exc:
            log.warning(
                "batch line to retry", extra={"batch_id": record.id, "line": line.line, "error": repr(exc)}
            )
            self._again(job, line)
            return
        except asyncio.CancelledError:
            if not self.stopping and job.record.status == "in_progress":
                job.pending.appendleft(line)
            raise
        finally:
            job.in_flight.pop(line.line, None)
            self.own_requests.discard(request_id)
        await self._record(job, result, "completed" if result.ok else "failed")

    def _again(self, job: Job, line: LineRequest) -> None:
        """Not now (capacity, quota, a lost stream): back to the queue's head, after a pause."""
        self.last_pushback_at = time.time()
        if job.record.status == "in_progress" and not self.stopping:
            job.pending.appendleft(line)

    async def _record(self, job: Job, result: LineResult, outcome: str) -> None:
        if await self._store.record_line(job.record.id, result):
            LINES.labels(outcome).inc()
        job.done[result.line] = result
        job.dirty = True

    # ------------------------------------------------------------ the batch's record

    async def _save_counts(self, job: Job, *, force: bool = False) -> None:
        now = time.time()
        if not job.dirty or (not force and now - job.saved_at < SAVE_EVERY_S):
            return
        counts = job.counts()

        def update(r: BatchRecord) -> BatchRecord | None:
            if r.status in ("completed", "failed", "expired", "cancelled") or r.request_counts == counts:
                return None
            return msgspec.structs.replace(r, request_counts=counts)

        job.record = await self._store.modify(job.record.id, update) or job.record
        job.dirty, job.saved_at = False, now

    async def _fail(self, job: Job, code: str, message: str) -> None:
        now = int(time.time())
        error = BatchLineError(code=code, message=message)

        def fail(r: BatchRecord) -> BatchRecord | None:
            return msgspec.structs.replace(r, status="failed", failed_at=now, errors=[*r.errors, error])

        job.record = await self._store.modify(job.record.id, fail) or job.record

    async def _finalize(self, job: Job, final: str) -> None:
        """Write the output and error files of what finished, then the batch's final status.
        Lines that never ran (cancelled, expired) are in neither file but an expired batch's,
        which says for each that it expired."""
        record = job.record
        started = int(time.time())
        if final == "completed" and record.status != "finalizing":

            def finalizing(r: BatchRecord) -> BatchRecord | None:
                if r.status != "in_progress":
                    return None
                return msgspec.structs.replace(r, status="finalizing", finalizing_at=started)

            record = job.record = await self._store.modify(record.id, finalizing) or record
            if record.status != "finalizing":
                return  # cancelled meanwhile: the next tick winds it down
        # What this runner recorded, and what the store holds (a runner before it recorded too).
        results = {**job.done, **await self._store.lines(record.id)}
        if final == "expired":
            content = await self._store.content(record.input_file_id) or b""
            for number, _ in split_lines(content):
                if number not in results:
                    results[number] = LineResult(
                        line=number,
                        ok=False,
                        output=failure_line(
                            record.id,
                            number,
                            None,
                            code="batch_expired",
                            message=f"line {number}: not run within the batch's completion window",
                        ),
                    )
        ordered = [results[n] for n in sorted(results)]
        output_id = await self._write_file(record, "output", [r.output for r in ordered if r.ok])
        error_id = await self._write_file(record, "error", [r.output for r in ordered if not r.ok])
        ok = sum(1 for r in ordered if r.ok)
        counts = RequestCounts(
            total=job.total or record.request_counts.total, completed=ok, failed=len(ordered) - ok
        )
        now = int(time.time())
        stamps = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}

        def finish(r: BatchRecord) -> BatchRecord | None:
            if r.status in ("completed", "failed", "expired", "cancelled"):
                return None
            if final == "completed" and r.status != "finalizing":
                return None
            return msgspec.structs.replace(
                r,
                status=final,
                output_file_id=output_id,
                error_file_id=error_id,
                request_counts=counts,
                **{stamps[final]: now},
            )

        job.record = await self._store.modify(record.id, finish) or job.record
        job.dirty = False
        log.info(
            "batch finished",
            extra={"batch_id": record.id, "status": job.record.status, "lines": len(ordered)},
        )

    async def _write_file(self, record: BatchRecord, kind: str, rows: list[dict[str, Any]]) -> str | None:
        if not rows:
            return None
        content = jsonl(rows)
        file = FileRecord(
            id=new_id("file-"),
            tenant=record.tenant,
            bytes=len(content),
            created_at=int(time.time()),
            filename=f"{record.id}_{kind}.jsonl",
            purpose="batch_output",
        )
        await self._store.put_file(file, content)
        return file.id
