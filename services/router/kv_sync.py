"""Keeping the router's KV index (`kv_index.py`) current from the bus.

- Every worker's prefix-cache changes arrive as `KvEvents` batches on core NATS ``rmesh.kv.<worker>``
  (``rmesh.kv.*``, which does not match the dump subjects ``rmesh.kv.<worker>.dump``). Each is
  decoded strictly, checked against its subject, and applied; the outcome is counted.
- A worker whose blocks the index cannot vouch for (discovered by its heartbeat or its events, a
  gap in its batches, a mismatch, a new incarnation, the router just started) gets its full
  contents by request/reply on ``rmesh.kv.<worker>.dump``, in chunks that each fit in one message
  (`services/mesh/kv_dump.py`); batches that arrive meanwhile are held by the index and applied on
  top. Each chunk is waited for at most `dump_timeout_s`; failures back off
  exponentially (with jitter) up to `DUMP_BACKOFF_MAX_S`; a mismatched block size is retried only
  every `MISMATCH_RETRY_S`.
- Liveness comes from the WORKERS bucket (the router service feeds `observe` and `forget`): a
  worker whose heartbeat is older than `LIVENESS_S`, or whose entry is deleted, is dropped from the
  index, and its events are ignored until a fresh heartbeat; a worker that only ever sent events
  is dropped after `UNANNOUNCED_GRACE_S`. A heartbeat, a batch or a dump with a new `started_at` is
  a new incarnation: its old blocks go and it is resynced; a batch of an older one is ignored.

Everything runs in one task (`run`), which the router starts with `runtime.spawn`; cancelling it
ends the reader, the scheduler and any dump request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from prometheus_client import Counter, Gauge

from schemas.events import KvDump, KvEvents, WorkerState
from schemas.subjects import PREFIX, kv_dump_subject
from services.mesh import kv_dump
from services.router.kv_index import KvIndex, Outcome
from services.router.policy import LIVENESS_S

log = logging.getLogger(__name__)

KV_EVENTS_SUBJECT = f"{PREFIX}.kv.*"
DUMP_TIMEOUT_S = 2.0
DUMP_BACKOFF_BASE_S = 0.1
DUMP_BACKOFF_MAX_S = 10.0
MISMATCH_RETRY_S = 30.0
UNANNOUNCED_GRACE_S = 10.0
FORGET_DEAD_AFTER_S = 300.0
MAX_DUMPS_IN_FLIGHT = 32
TICK_S = 0.1
LOG_EVERY_S = 5.0

KV_EVENTS = Counter(
    "ripplemesh_router_kv_events_total",
    "KV event batches received, by outcome (applied, duplicate, gap, stale, mismatch, unknown, "
    "restarted, superseded, ahead, invalid, dead_worker, error); ahead also counts held batches "
    "a dump dropped as too far past its seq.",
    ["outcome"],
)
KV_DUMPS = Counter(
    "ripplemesh_router_kv_dumps_total",
    "KV dump requests, by outcome (applied, stale, mismatch, restarted, superseded, timeout, "
    "no_responders, invalid, error, discarded).",
    ["outcome"],
)
KV_DROPPED = Counter(
    "ripplemesh_router_kv_workers_dropped_total",
    "Workers dropped from the KV index, by reason.",
    ["reason"],
)
KV_BLOCKS = Gauge("ripplemesh_router_kv_indexed_blocks", "Indexed (worker, block) pairs.")
KV_DISTINCT = Gauge("ripplemesh_router_kv_distinct_blocks", "Distinct block hashes in the index.")
KV_WORKERS = Gauge("ripplemesh_router_kv_workers", "Workers in the KV index, by state.", ["state"])

_events_decoder = msgspec.json.Decoder(KvEvents)
_dump_decoder = msgspec.json.Decoder(KvDump)


@dataclass(slots=True)
class _Peer:
    first_seen: float
    started_at: float | None = None
    heartbeat_at: float | None = None  # None: known only from its events
    model: str | None = None
    dead: bool = False
    dead_since: float = 0.0
    # Bumped whenever the peer starts over (new incarnation, revival): older dumps are discarded.
    generation: int = 0
    attempts: int = 0
    next_dump_at: float = 0.0
    dump_in_flight: bool = False


class KvSync:
    def __init__(
        self,
        nc: NatsClient,
        index: KvIndex,
        *,
        dump_timeout_s: float = DUMP_TIMEOUT_S,
        liveness_s: float = LIVENESS_S,
        unannounced_grace_s: float = UNANNOUNCED_GRACE_S,
        clock: Callable[[], float] = time.time,
    ):
        self.nc = nc
        self.index = index
        self.dump_timeout_s = dump_timeout_s
        self.liveness_s = liveness_s
        self.unannounced_grace_s = unannounced_grace_s
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self._wake = asyncio.Event()
        self._dumps_in_flight = 0
        self._logged_at: dict[tuple[str, str], float] = {}
        self._rng = random.Random()
        # Set while the events subscription is up (tests wait on it).
        self.subscribed = asyncio.Event()

    # ------------------------------------------------------------ liveness (from WORKERS)

    def observe(self, state: WorkerState) -> None:
        """A heartbeat: discovery, liveness and incarnation of a worker."""
        now = self.clock()
        worker_id = state.worker_id
        fresh = now - state.occurred_at <= self.liveness_s
        peer = self._peers.get(worker_id)
        if peer is None:
            peer = self._peers[worker_id] = _Peer(first_seen=now)
        elif peer.heartbeat_at is not None and state.occurred_at < peer.heartbeat_at:
            return  # an older heartbeat than one already seen
        restarted = peer.started_at is not None and state.started_at != peer.started_at
        peer.started_at = state.started_at
        peer.heartbeat_at = state.occurred_at
        peer.model = state.model
        if not fresh:
            return  # the sweep drops it if the index holds it
        if restarted:
            if self.index.drop_worker(worker_id):
                KV_DROPPED.labels("restarted").inc()
            log.info("worker restarted: resyncing its KV blocks", extra={"worker_id": worker_id})
            self._start_over(peer, worker_id, now)
        elif peer.dead:
            log.info("worker back: resyncing its KV blocks", extra={"worker_id": worker_id})
            self._start_over(peer, worker_id, now)
        elif worker_id not in self.index:
            self._start_over(peer, worker_id, now)

    def forget(self, worker_id: str) -> None:
        """The worker's WORKERS entry was deleted (it stopped)."""
        peer = self._peers.get(worker_id)
        if peer is not None and not peer.dead:
            self._mark_dead(peer, self.clock())
        if self.index.drop_worker(worker_id):
            KV_DROPPED.labels("deleted").inc()

    def _start_over(self, peer: _Peer, worker_id: str, now: float) -> None:
        peer.dead = False
        peer.generation += 1
        peer.attempts = 0
        peer.next_dump_at = now
        self.index.resync(worker_id, model=peer.model, started_at=peer.started_at)
        self._wake.set()

    def _mark_dead(self, peer: _Peer, now: float) -> None:
        peer.dead = True
        peer.dead_since = now
        peer.generation += 1

    def _sweep(self, now: float) -> None:
        for worker_id, peer in list(self._peers.items()):
            if peer.dead:
                if now - peer.dead_since > FORGET_DEAD_AFTER_S:
                    del self._peers[worker_id]
                continue
            if peer.heartbeat_at is not None:
                if now - peer.heartbeat_at <= self.liveness_s:
                    continue
                reason = "dead"
            elif now - peer.first_seen > self.unannounced_grace_s:
                reason = "unannounced"
                self._note(worker_id, reason, "KV events from a worker with no heartbeat: dropped")
            else:
                continue
            self._mark_dead(peer, now)
            if self.index.drop_worker(worker_id):
                KV_DROPPED.labels(reason).inc()
                log.info(
                    "worker gone: its KV blocks dropped", extra={"worker_id": worker_id, "reason": reason}
                )

    # ------------------------------------------------------------ events

    def handle_message(self, subject: str, data: bytes) -> str:
        """One message on ``rmesh.kv.<worker>``: decode, check, apply. Returns the outcome counted."""
        parts = subject.split(".")
        try:
            events = _events_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            KV_EVENTS.labels("invalid").inc()
            self._note(subject, "invalid", "undecodable KV events ignored", error=str(exc))
            return "invalid"
        if len(parts) != 3 or parts[2] != events.worker_id:
            KV_EVENTS.labels("invalid").inc()
            self._note(subject, "invalid", "KV events for another worker than their subject's: ignored")
            return "invalid"
        worker_id = events.worker_id
        now = self.clock()
        peer = self._peers.get(worker_id)
        if peer is None:
            peer = self._peers[worker_id] = _Peer(first_seen=now)
        elif peer.dead:
            KV_EVENTS.labels("dead_worker").inc()
            self._note(worker_id, "dead_worker", "KV events from a worker without a live heartbeat: ignored")
            return "dead_worker"
        outcome = self.index.apply(events)
        KV_EVENTS.labels(outcome.value).inc()
        if outcome is not Outcome.APPLIED:
            self._note(
                worker_id,
                outcome.value,
                f"KV events {outcome.value}",
                seq=events.seq,
                index_seq=self.index.seq(worker_id),
                model=events.model,
                block_size=events.block_size,
            )
        if self.index.needs_dump(worker_id) and not peer.dump_in_flight and peer.attempts == 0:
            peer.next_dump_at = min(peer.next_dump_at, now)
            self._wake.set()
        return outcome.value

    async def _read(self) -> None:
        while True:
            try:
                sub = await self.nc.subscribe(KV_EVENTS_SUBJECT)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("KV events subscription failed; retrying", extra={"error": repr(exc)})
                await asyncio.sleep(1.0)
                continue
            self.subscribed.set()
            try:
                async for msg in sub.messages:
                    try:
                        self.handle_message(msg.subject, msg.data)
                    except Exception:  # never let one message stop the index
                        KV_EVENTS.labels("error").inc()
                        log.exception("KV events handling failed", extra={"subject": msg.subject})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("KV events subscription broke; resubscribing", extra={"error": repr(exc)})
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------ dumps

    async def _schedule(self, tasks: asyncio.TaskGroup) -> None:
        while True:
            self._wake.clear()
            try:
                now = self.clock()
                self._sweep(now)
                for worker_id, peer in self._peers.items():
                    if self._dumps_in_flight >= MAX_DUMPS_IN_FLIGHT:
                        break
                    if (
                        peer.dead
                        or peer.dump_in_flight
                        or peer.next_dump_at > now
                        or not self.index.needs_dump(worker_id)
                    ):
                        continue
                    peer.dump_in_flight = True
                    self._dumps_in_flight += 1
                    tasks.create_task(
                        self._dump(worker_id, peer, peer.generation), name=f"kv-dump-{worker_id}"
                    )
                self._update_gauges()
            except Exception:
                log.exception("KV sync scheduling failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=TICK_S)

    async def _dump(self, worker_id: str, peer: _Peer, generation: int) -> None:
        outcome: str
        try:
            try:
                dump = await self._request_dump(worker_id)
            except NoRespondersError:
                outcome = "no_responders"
            except TimeoutError:
                outcome = "timeout"
            except (msgspec.DecodeError, msgspec.ValidationError, kv_dump.DumpError) as exc:
                outcome = "invalid"
                self._note(worker_id, "dump_invalid", "invalid KV dump ignored", error=str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outcome = "error"
                self._note(worker_id, "dump_error", "KV dump request failed", error=repr(exc))
            else:
                if dump.worker_id != worker_id:
                    outcome = "invalid"
                elif peer.dead or peer.generation != generation or self._peers.get(worker_id) is not peer:
                    outcome = "discarded"  # the worker died or started over meanwhile
                else:
                    dropped = self.index.dropped_ahead
                    outcome = self.index.apply_dump(dump).value
                    if dropped := self.index.dropped_ahead - dropped:
                        KV_EVENTS.labels("ahead").inc(dropped)
                        self._note(
                            worker_id,
                            "ahead",
                            "held KV events too far past the dump's seq dropped",
                            dropped=dropped,
                            dump_seq=dump.seq,
                        )
        finally:
            peer.dump_in_flight = False
            self._dumps_in_flight -= 1
        KV_DUMPS.labels(outcome).inc()
        now = self.clock()
        if outcome == "discarded":
            pass
        elif outcome == Outcome.APPLIED and not self.index.needs_dump(worker_id):
            peer.attempts = 0
        else:
            peer.attempts += 1
            if outcome == Outcome.MISMATCH:
                delay = MISMATCH_RETRY_S
            else:
                delay = min(DUMP_BACKOFF_MAX_S, DUMP_BACKOFF_BASE_S * 2 ** (peer.attempts - 1))
                delay *= self._rng.uniform(0.5, 1.0)
            peer.next_dump_at = now + delay
            self._note(
                worker_id,
                f"dump_{outcome}",
                "KV resync not complete; retrying",
                outcome=outcome,
                retry_in_s=delay,
            )
        self._wake.set()

    async def _request_dump(self, worker_id: str) -> KvDump:
        """Ask the worker for its dump in chunks that each fit in one message; put them together.

        Raises NoRespondersError, TimeoutError (a chunk took over `dump_timeout_s`), or a decode
        or DumpError for chunks that do not make one dump."""
        inbox = self.nc.new_inbox()
        sub: Subscription = await self.nc.subscribe(inbox)
        try:
            body = kv_dump.encode_request(kv_dump.max_blocks_for(self.nc.max_payload))
            await self.nc.publish(kv_dump_subject(worker_id), body, reply=inbox)
            chunks = kv_dump.Assembler()
            while not chunks.complete:
                msg = await sub.next_msg(timeout=self.dump_timeout_s)
                if msg.headers and msg.headers.get("Status") == "503":
                    raise NoRespondersError
                chunks.add(_dump_decoder.decode(msg.data))
            return chunks.dump()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # ------------------------------------------------------------ the task

    async def run(self) -> None:
        """Read events and fetch dumps until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._read(), name="kv-events")
            tasks.create_task(self._schedule(tasks), name="kv-dumps")

    # ------------------------------------------------------------ reporting

    def _update_gauges(self) -> None:
        stats = self.index.stats()
        KV_BLOCKS.set(stats["blocks"])
        KV_DISTINCT.set(stats["distinct_blocks"])
        KV_WORKERS.labels("synced").set(stats["synced"])
        KV_WORKERS.labels("resyncing").set(stats["resyncing"])

    def health(self, *, max_workers: int = 64) -> dict[str, Any]:
        by_worker = {
            worker_id: {
                "blocks": self.index.block_count(worker_id),
                "seq": self.index.seq(worker_id),
                "synced": self.index.synced(worker_id),
            }
            for worker_id in sorted(self.index.worker_ids)[:max_workers]
        }
        return {**self.index.stats(), "by_worker": by_worker}

    def _note(self, key: str, what: str, message: str, **extra: Any) -> None:
        """Log bad input at most once per `LOG_EVERY_S` per (worker or subject, kind)."""
        now = time.monotonic()
        if now - self._logged_at.get((key, what), -LOG_EVERY_S) < LOG_EVERY_S:
            return
        if len(self._logged_at) > 10_000:
            self._logged_at.clear()
        self._logged_at[(key, what)] = now
        log.warning(message, extra={"worker_or_subject": key, **extra})
