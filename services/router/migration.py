"""Taking over the work of workers that die or are drained: liveness, then mid-stream migration.

Every router replica runs a `Migrator` (the router service starts it):

- **Liveness** (`liveness.py`, pure). It watches the WORKERS bucket itself. A worker whose latest
  heartbeat is 2 s old is probed on ``rmesh.control.<worker>``: "no responders" means its NATS
  connection is gone (killed, crashed), and it is lost at once; at 3 s without a heartbeat it is
  lost whatever the probe said. A lost worker's WORKERS entry is deleted (conditionally on the
  revision seen, so a late heartbeat is never erased): every router drops it and its KV blocks
  from its index, and admission and the autoscaler stop counting its capacity.
- **Take-over.** A worker is *gone* once its WORKERS entry is deleted (lost, stopped, drained).
  Its unfinished work is still on the WORK stream: a work queue keeps a message until the worker
  acks it, which a worker does only once the request's stream is complete. The migrator reads
  those messages (``rmesh.work.{prefill,decode}.<worker>``, by direct get) and for each one reads
  what the client already received from the TOKENS stream (bounded: up to the last event stored
  when it starts), then (`resume.py`) places the request again: a `RequestAdmitted` carrying the
  prompt plus the delivered tokens, `max_tokens` reduced and the next sequence number
  (`Resumption`), which the router places through its policy like any admitted request. The old
  message is deleted, the old worker told to drop the request (``revoke``, in case it was only
  slow) and a `RequestMigrated` recorded. Past `max_migrations` the stream fails with a clear
  `StreamFailed` instead. A stream already complete whose worker died before reporting it gets
  that report from the migrator (`_completed_for`: the same event id, no GPU time), so the
  ledger counts the request once.
- **Replicas.** Every replica sees the same deaths and takes over the same work: the events it
  publishes have ids derived from (request, migration number), so JetStream's duplicate window
  keeps one re-placement, and one `RequestMigrated`.
- Gone workers are scanned again every second for a minute (a prefill worker may hand a decode
  to a worker that just died), and work left on the subjects of workers nobody has heard of (a
  router restarted after they died) is swept every 10 s.

The migration's span is the root of its own trace, linked to the original placement's span.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import nats.js.api as jsapi
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.errors import BadRequestError, NotFoundError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind
from prometheus_client import Counter, Histogram

from schemas.events import (
    DeadLetter,
    DecodeWork,
    PrefillWork,
    RequestAdmitted,
    RequestCancelled,
    RequestFailed,
    RequestMigrated,
    StreamFailed,
    StreamFinished,
    Usage,
    WorkerControl,
    WorkerState,
    WorkItem,
    derived_event_id,
    encode_event,
    new_event_id,
)
from schemas.subjects import (
    PREFIX,
    WORK,
    WORKERS,
    admitted_subject,
    control_subject,
    dlq_subject,
    event_subject,
    tokens_subject,
    work_subject,
)
from services.mesh.completion import decode_completed, sent_at
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.runtime import Runtime
from services.mesh.token_stream import stored_events
from services.mesh.tracing import REQUEST_ID, extract_context, tracer
from services.router.liveness import GoneReason, Liveness
from services.router.resume import AlreadyEnded, FinishNow, GiveUp, Resume, delivered, plan

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
READ_TIMEOUT_S = 5.0
TAKEOVERS_IN_FLIGHT = 32
MAX_SCANNED_PER_SUBJECT = 10_000
ORPHAN_SWEEP_EVERY_S = 10.0
CANCELS_KEPT = 100_000
# JetStream's error code for a conditional write whose expected last sequence is not the last.
WRONG_LAST_SEQUENCE = 10071

TakeOverOutcome = Literal["migrated", "failed", "finished", "ended", "cancelled", "dead_lettered"]

TAKEOVERS = Counter(
    "ripplemesh_router_takeovers_total",
    "Work taken from gone workers, by outcome (migrated, failed: past the migration limit, "
    "finished, ended: already complete, cancelled, dead_lettered) and reason.",
    ["outcome", "reason"],
)
WORKERS_LOST = Counter(
    "ripplemesh_router_workers_lost_total",
    "Workers this router declared lost, by how (silent: no heartbeat; no_responders: its probe).",
    ["how"],
)
for _how in ("silent", "no_responders"):  # both series from the start: increase() sees the first
    WORKERS_LOST.labels(_how)
DETECTION = Histogram(
    "ripplemesh_router_worker_loss_detection_seconds",
    "From a lost worker's last heartbeat to this router declaring it lost.",
    buckets=(0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 10),
)

_work_decoder: msgspec.json.Decoder[WorkItem] = msgspec.json.Decoder(WorkItem)
_worker_decoder = msgspec.json.Decoder(WorkerState)
_cancel_decoder = msgspec.json.Decoder(RequestCancelled)


_REASON_TEXT: dict[GoneReason, str] = {"worker_lost": "was lost", "worker_drained": "was drained"}


class Migrator:
    def __init__(
        self,
        runtime: Runtime,
        *,
        max_migrations: int,
        max_output_tokens: int | None = None,
        liveness: Liveness | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.runtime = runtime
        self.max_migrations = max_migrations
        self.max_output_tokens = max_output_tokens
        self.liveness = liveness or Liveness()
        self.clock = clock
        self._wake = asyncio.Event()
        self._scanning: set[str] = set()
        self._declaring: set[str] = set()
        self._declare_tried: dict[str, float] = {}
        self._orphans: dict[str, float] = {}
        self._cancelled: OrderedDict[str, str] = OrderedDict()
        self._gpu_types: dict[str, str] = {}
        self._slots = asyncio.Semaphore(TAKEOVERS_IN_FLIGHT)
        self.outcomes: dict[str, int] = {}
        self.workers_watch: HeartbeatWatch | None = None

    async def start(self) -> None:
        await self.runtime.bus.nc.subscribe(event_subject("cancelled"), cb=self._on_cancelled)
        self.runtime.spawn(self._watch(), "migration-watch")
        self.runtime.spawn(self._run(), "migration")
        self.runtime.spawn(self._sweep_orphans(), "migration-orphans")

    def health(self) -> dict[str, Any]:
        return {
            "alive": sorted(self.liveness.alive),
            "gone": sorted(self.liveness.gone),
            "takeovers": dict(self.outcomes),
        }

    # ------------------------------------------------------------ liveness

    async def _watch(self) -> None:
        # Started again when it breaks or falls silent (its consumer lost with a NATS node);
        # stale soon after a fleet-wide silence, before any worker's silence would count.
        self.workers_watch = HeartbeatWatch(
            await self.runtime.bus.key_value(WORKERS), stale_after_s=self.liveness.liveness_s / 2
        )
        async for entry in self.workers_watch.updates():
            if entry.operation in ("DEL", "PURGE"):
                self.liveness.removed(entry.key, self.clock())
            elif entry.value:
                try:
                    state = _worker_decoder.decode(entry.value)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue  # the router's own watch logs it
                self._gpu_types[state.worker_id] = state.gpu_type
                self.liveness.heartbeat(
                    state.worker_id, state.occurred_at, entry.revision or 0, state.draining, state.started_at
                )
            self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                self._act(self.clock())
            except Exception:
                log.exception("migration scheduling failed")
            now = self.clock()
            delay = max(0.01, self.liveness.next_due(now) - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)

    def _act(self, now: float) -> None:
        verdicts = self.liveness.verdicts(now)
        # No heartbeat from anyone while WORKERS cannot be read (a NATS node lost, the bucket's
        # stream electing a leader): silence is no evidence of death then (a probe's "no
        # responders" still is).
        view_stale = self.workers_watch is not None and self.workers_watch.stale
        for worker_id, revision in [] if view_stale else verdicts.lost:
            if now - self._declare_tried.get(worker_id, -1.0) >= 0.5:
                self._declare_tried[worker_id] = now
                self.runtime.spawn(self._declare_lost(worker_id, revision, "silent"), "declare-lost")
        for worker_id in verdicts.probe:
            self.liveness.probed(worker_id, now)
            self.runtime.spawn(self._probe(worker_id), "probe")
        for worker_id, reason in verdicts.scan:
            if worker_id not in self._scanning:
                self._scanning.add(worker_id)
                self.liveness.scanned(worker_id, now)
                self.runtime.spawn(self._scan(worker_id, reason), "take-over")
        for worker_id, cutoff in verdicts.predecessors:
            if worker_id not in self._scanning:
                self._scanning.add(worker_id)
                self.liveness.predecessor_scanned(worker_id, now)
                self.runtime.spawn(self._scan(worker_id, "worker_lost", before=cutoff), "take-over")

    async def _probe(self, worker_id: str) -> None:
        known = self.liveness.alive.get(worker_id)
        if known is None:
            return
        ping = WorkerControl(
            event_id=new_event_id(), occurred_at=time.time(), worker_id=worker_id, action="ping"
        )
        try:
            await self.runtime.bus.nc.request(
                control_subject(worker_id), encode_event(ping), timeout=PROBE_TIMEOUT_S
            )
        except NoRespondersError:
            await self._declare_lost(worker_id, known.revision, "no_responders")
        except Exception:
            return  # no answer in time: the heartbeat's age decides

    async def _declare_lost(self, worker_id: str, revision: int, how: str) -> None:
        known = self.liveness.alive.get(worker_id)
        if known is None or known.revision != revision or worker_id in self._declaring:
            return
        self._declaring.add(worker_id)
        try:
            kv = await self.runtime.bus.key_value(WORKERS)
            try:
                await kv.delete(worker_id, last=revision)
            except BadRequestError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    return  # a newer heartbeat, or another router's delete: the watch brings it
                raise
            now = self.clock()
            DETECTION.observe(max(0.0, now - known.heartbeat_at))
            WORKERS_LOST.labels(how).inc()
            log.warning(
                "worker lost: taking over its work",
                extra={
                    "worker_id": worker_id,
                    "how": how,
                    "silent_for_s": round(now - known.heartbeat_at, 3),
                },
            )
            self.liveness.lost(worker_id, now)
            self._wake.set()
        except Exception as exc:
            log.warning("declaring a worker lost failed", extra={"worker_id": worker_id, "error": repr(exc)})
        finally:
            self._declaring.discard(worker_id)

    async def _sweep_orphans(self) -> None:
        """Work on the subjects of workers nobody has heard of for a while (they died while no
        router ran) is taken over too."""
        js = self.runtime.bus.js
        while True:
            await asyncio.sleep(ORPHAN_SWEEP_EVERY_S)
            try:
                info = await js.stream_info(WORK.name, subjects_filter=f"{PREFIX}.work.>")
                subjects = (info.state.subjects or {}) if info.state else {}
                now = self.clock()
                holders = {subject.rsplit(".", 1)[-1] for subject in subjects}
                for worker_id in holders:
                    if worker_id in self.liveness.alive or worker_id in self.liveness.gone:
                        self._orphans.pop(worker_id, None)
                        continue
                    first_seen = self._orphans.setdefault(worker_id, now)
                    if now - first_seen >= self.liveness.liveness_s:
                        log.warning(
                            "work of an unknown worker: taking it over", extra={"worker_id": worker_id}
                        )
                        del self._orphans[worker_id]
                        self.liveness.lost(worker_id, now)
                        self._wake.set()
                for worker_id in list(self._orphans):
                    if worker_id not in holders:
                        del self._orphans[worker_id]
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("orphaned work sweep failed", extra={"error": repr(exc)})

    # ------------------------------------------------------------ taking work over

    async def _on_cancelled(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            cancelled = _cancel_decoder.decode(msg.data)
            self._cancelled[cancelled.request_id] = cancelled.tenant
            while len(self._cancelled) > CANCELS_KEPT:
                self._cancelled.popitem(last=False)

    async def _scan(self, worker_id: str, reason: GoneReason, before: float | None = None) -> None:
        """Take over every message left on the gone worker's work subjects (those sent before
        `before` only: a restarted worker's predecessor's)."""
        try:
            found: list[tuple[Literal["prefill", "decode"], jsapi.RawStreamMsg]] = []
            for phase in ("prefill", "decode"):
                subject = work_subject(phase, worker_id)
                seq = 1
                for _ in range(MAX_SCANNED_PER_SUBJECT):
                    try:
                        raw = await self.runtime.bus.js.get_msg(
                            WORK.name, seq=seq, subject=subject, next=True
                        )
                    except NotFoundError:
                        break
                    seq = (raw.seq or seq) + 1
                    if before is not None and sent_at(raw.data) >= before:
                        break  # the new incarnation's work, and all after it on the subject
                    found.append((phase, raw))
            if found:
                log.info(
                    "taking over a gone worker's work",
                    extra={"worker_id": worker_id, "reason": reason, "messages": len(found)},
                )
            await asyncio.gather(
                *(self._bounded_take_over(raw, worker_id, phase, reason) for phase, raw in found)
            )
        except Exception as exc:  # scanned again in a second
            log.warning("taking over work failed", extra={"worker_id": worker_id, "error": repr(exc)})
        finally:
            self._scanning.discard(worker_id)

    async def _bounded_take_over(
        self, raw: jsapi.RawStreamMsg, worker_id: str, phase: Literal["prefill", "decode"], reason: GoneReason
    ) -> None:
        async with self._slots:
            try:
                outcome = await self._take_over(raw, worker_id, phase, reason)
            except Exception as exc:  # left on the stream: the next scan tries again
                log.warning(
                    "taking over one request failed", extra={"worker_id": worker_id, "error": repr(exc)}
                )
                return
        TAKEOVERS.labels(outcome, reason).inc()
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def _take_over(
        self, raw: jsapi.RawStreamMsg, worker_id: str, phase: Literal["prefill", "decode"], reason: GoneReason
    ) -> TakeOverOutcome:
        bus = self.runtime.bus
        try:
            item = _work_decoder.decode(raw.data or b"")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await bus.publish(
                dlq_subject(WORK.name),
                DeadLetter(
                    event_id=derived_event_id(f"{WORK.name}:{raw.seq}", "takeover"),
                    occurred_at=time.time(),
                    stream=WORK.name,
                    consumer="router-migration",
                    subject=raw.subject or "",
                    reason=f"undecodable work of gone worker {worker_id}: {exc}"[:2000],
                    num_delivered=0,
                    headers=dict(raw.headers or {}),
                    data=raw.data or b"",
                ),
            )
            await self._delete(raw)
            return "dead_lettered"
        request = item.request
        rid = request.request_id
        if self._cancelled.get(rid) == request.tenant:
            await self._delete(raw)
            return "cancelled"
        stored = await stored_events(bus.nc, tokens_subject(request.tenant, rid), timeout_s=READ_TIMEOUT_S)
        got = delivered(request, stored)
        decision = plan(
            request,
            got,
            max_migrations=self.max_migrations,
            max_output_tokens=self.max_output_tokens,
            from_worker=worker_id,
            reason=_REASON_TEXT[reason],
        )
        now = time.time()
        workflow = request.workflow
        if isinstance(decision, AlreadyEnded):
            finished = next((e for e in stored if isinstance(e, StreamFinished)), None)
            if finished is not None:
                await self._completed_for(item, worker_id, finished.usage, finished.finish_reason, now)
            await self._delete(raw)
            return "ended"
        if isinstance(decision, FinishNow):
            await bus.publish(
                tokens_subject(request.tenant, rid),
                StreamFinished(
                    event_id=f"{rid}-{decision.seq}",
                    occurred_at=now,
                    request_id=rid,
                    seq=decision.seq,
                    finish_reason="length",
                    usage=decision.usage,
                ),
            )
            await self._completed_for(item, worker_id, decision.usage, "length", now)
            await self._delete(raw)
            return "finished"
        if isinstance(decision, GiveUp):
            log.warning("migration limit reached: the request fails", extra={"request_id": rid})
            await bus.publish(
                tokens_subject(request.tenant, rid),
                StreamFailed(
                    event_id=f"{rid}-{decision.seq}",
                    occurred_at=now,
                    request_id=rid,
                    seq=decision.seq,
                    code="internal",
                    message=decision.message,
                    http_status=503,
                ),
            )
            await bus.publish(
                event_subject("failed"),
                RequestFailed(
                    event_id=derived_event_id(rid, f"migration-{decision.migration}-failed"),
                    occurred_at=now,
                    request_id=rid,
                    tenant=request.tenant,
                    workflow_id=workflow.workflow_id if workflow else None,
                    stage="router",
                    worker_id=worker_id,
                    message=decision.message,
                    workflow_step=workflow.step if workflow else None,
                    workflow_steps=workflow.steps if workflow else None,
                    deadline_at=request.deadline_at,
                    service_class=request.service_class,
                ),
            )
            await self._delete(raw)
            await self._revoke(worker_id, rid, item.event_id, "migration limit reached")
            return "failed"
        assert isinstance(decision, Resume)
        await self._migrate(raw, item.event_id, decision, worker_id, phase, reason)
        return "migrated"

    async def _completed_for(
        self,
        item: WorkItem,
        worker_id: str,
        usage: Usage,
        finish_reason: Literal["stop", "length"],
        now: float,
    ) -> None:
        """The completion a worker lost between its stream's end and its report would have
        published, for the ledger: the same event id (a late report from a worker that was only
        slow is then stored once), its usage from the stream, no GPU time (the lost worker's is
        not known). Only for the work that reports completions: a decode, or an aggregated
        prefill (the decode side of a hand-off reports its own)."""
        if isinstance(item, PrefillWork) and item.prefill_worker != item.decode_worker:
            return
        await self.runtime.bus.publish(
            event_subject("decode_completed"),
            decode_completed(
                item.request,
                item.event_id,
                now=now,
                worker_id=worker_id,
                gpu_type=self._gpu_types.get(worker_id, "unknown"),
                gpu_seconds=0.0,
                kv_transfer_bytes=item.kv.kv_bytes if isinstance(item, DecodeWork) else 0,
                usage=usage,
                finish_reason=finish_reason,
            ),
        )

    async def _migrate(
        self,
        raw: jsapi.RawStreamMsg,
        work_event_id: str,
        decision: Resume,
        worker_id: str,
        phase: Literal["prefill", "decode"],
        reason: GoneReason,
    ) -> None:
        bus = self.runtime.bus
        request = decision.request
        rid = request.request_id
        workflow = request.workflow
        resume_seq = request.resumption.next_seq if request.resumption else 0
        original = trace.get_current_span(extract_context(raw.headers)).get_span_context()
        links = [Link(original, {"ripple.link": "original_placement"})] if original.is_valid else []
        with tracer().start_as_current_span(
            "router.migrate",
            context=otel_context.Context(),  # a trace of its own, linked to the placement
            kind=SpanKind.INTERNAL,
            links=links,
            attributes={
                REQUEST_ID: rid,
                "ripple.migration.number": decision.migration,
                "ripple.migration.reason": reason,
                "ripple.migration.from_worker": worker_id,
                "ripple.migration.from_phase": phase,
                "ripple.migration.resume_seq": resume_seq,
                "ripple.migration.delivered_tokens": decision.delivered_tokens,
                "ripple.migration.remaining_tokens": decision.remaining_tokens,
            },
        ):
            now = time.time()
            # Placed again by the router's policy, like any admitted request; the id is the same
            # in every router replica, so it is placed once.
            await bus.publish(
                admitted_subject(request.priority),
                RequestAdmitted(
                    event_id=derived_event_id(rid, f"migration-{decision.migration}"),
                    occurred_at=now,
                    request=request,
                    waited_s=0.0,
                ),
            )
            await bus.publish(
                event_subject("migrated"),
                RequestMigrated(
                    event_id=derived_event_id(rid, f"migrated-{decision.migration}"),
                    occurred_at=now,
                    request_id=rid,
                    tenant=request.tenant,
                    migration=decision.migration,
                    reason=reason,
                    from_worker=worker_id,
                    from_phase=phase,
                    resume_seq=resume_seq,
                    delivered_tokens=decision.delivered_tokens,
                    remaining_tokens=decision.remaining_tokens,
                    workflow_id=workflow.workflow_id if workflow else None,
                    workflow_step=workflow.step if workflow else None,
                    workflow_steps=workflow.steps if workflow else None,
                    deadline_at=request.deadline_at,
                ),
            )
        await self._delete(raw)
        await self._revoke(worker_id, rid, work_event_id, f"migrated ({reason})")
        log.info(
            "request migrated",
            extra={
                "request_id": rid,
                "from_worker": worker_id,
                "migration": decision.migration,
                "resume_seq": resume_seq,
                "delivered_tokens": decision.delivered_tokens,
            },
        )

    async def _delete(self, raw: jsapi.RawStreamMsg) -> None:
        if raw.seq is None:
            return
        with contextlib.suppress(NotFoundError):  # another router replica was first
            await self.runtime.bus.js.delete_msg(WORK.name, raw.seq)

    async def _revoke(self, worker_id: str, request_id: str, work_event_id: str, reason: str) -> None:
        """Tell the old worker to drop the request, in case it was only slow, not gone: the
        request as it runs for the work taken over, not for the work that replaced it (placed
        back on a restarted worker of the same id, it runs there under the same request id)."""
        order = WorkerControl(
            event_id=new_event_id(),
            occurred_at=time.time(),
            worker_id=worker_id,
            action="revoke",
            request_ids=[request_id],
            work_event_ids=[work_event_id],
            reason=reason,
        )
        with contextlib.suppress(Exception):
            await self.runtime.bus.nc.publish(control_subject(worker_id), encode_event(order))
