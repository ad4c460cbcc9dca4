"""The bus: one NATS connection per service, stream provisioning, traced publishing."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
import nats.js.api as jsapi
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from schemas.events import Event, encode_event
from schemas.subjects import (
    KV_BUCKETS,
    KV_OBJECTS_BUCKET,
    KV_OBJECTS_TTL_S,
    STREAMS,
    ConsumerSpec,
    KvBucketSpec,
    StreamSpec,
)
from services.mesh.nats_auth import NatsCredentials
from services.mesh.tracing import LateSpan, inject_headers, subject_family

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 5.0
# An acked publish keeps trying this long: past a stream leader's election after a node loss
# (5 to 15 s measured on a loaded 2-core machine). A handler that waits reports progress, so
# its own message stays its own meanwhile.
PUBLISH_RETRY_S = 30.0
# After a failed attempt, each further one waits this long at most for its ack: an election
# ends between two attempts, not inside one long wait.
RETRY_ATTEMPT_TIMEOUT_S = 2.0
# How long one look at a stream's leader waits for an answer while a service starts.
LEADER_POLL_S = 0.5
_RETRY_BACKOFF_S = (0.05, 0.1, 0.25, 0.5, 1.0)
# A fast publish on a replicated stream not acked within this long is published again, acked.
FAST_ACK_WAIT_S = 3.0
FAST_REPUBLISH_RETRY_S = 60.0

# What a JetStream publish or API call raises while a node is lost, a client reconnects or a
# stream elects a new leader: worth another try.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)


# The direct hand-off (consumer.py): a publish to a subject whose consumers take messages
# directly also goes, first, as a core NATS message to the same subject under DIRECT_PREFIX,
# which no stream captures (a core subscriber of a stream's own subject hears it a quarter
# millisecond later: the server ingests it into the stream first).
DIRECT_PREFIX = "rmesh.direct."
DIRECT_SOURCES = ("rmesh.prepared.", "rmesh.admitted.", "rmesh.work.")


def direct_handoff_enabled() -> bool:
    """``RIPPLEMESH_DIRECT_HANDOFF=1`` turns the direct hand-off on for the process. Off by
    default: measured, it did not lower the overhead beyond run-to-run noise (architecture §20),
    and it has failure modes the stream path has not (§6)."""
    return os.environ.get("RIPPLEMESH_DIRECT_HANDOFF", "0") == "1"


def direct_subject(subject: str) -> str:
    """Where the direct copy of a message on `subject` (or a filter) goes."""
    return DIRECT_PREFIX + subject.removeprefix("rmesh.")


def stream_subject_of(subject: str) -> str:
    """The stream's subject of a direct copy (a subject without the prefix is returned as is)."""
    if subject.startswith(DIRECT_PREFIX):
        return "rmesh." + subject[len(DIRECT_PREFIX) :]
    return subject


def nats_servers(url: str) -> list[str]:
    """A NATS URL may be a comma-separated list of cluster nodes; any of them will do."""
    return [part.strip() for part in url.split(",") if part.strip()]


def reconnecting_options(name: str, *, connect_timeout_s: float = 5.0) -> dict[str, Any]:
    """nats.connect options for a client that outlives any one node of a cluster.

    It reconnects forever, to any node it knows (the list it was given, and the others the
    cluster announces), a quarter second apart. A killed node's sockets close at once; a peer
    that goes silent without closing is detected by pings within about 15 s. Publishes made
    while reconnecting are buffered (up to 64 MiB) and sent on reconnect.
    """
    return {
        "name": name,
        "connect_timeout": connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
        "pending_size": 64 * 1024 * 1024,
    }


async def publish_acked(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float = PUBLISH_TIMEOUT_S,
    retry_s: float = PUBLISH_RETRY_S,
) -> jsapi.PubAck:
    """A JetStream publish retried through transient failures, for at most `retry_s` seconds.

    Every attempt carries the same ``Nats-Msg-Id`` header, so a retry of a publish whose ack was
    lost is stored once. The last error is raised when the time is up.
    """
    deadline = time.monotonic() + retry_s
    attempt = 0
    while True:
        remaining = deadline - time.monotonic()
        wait = timeout_s if attempt == 0 else min(timeout_s, RETRY_ATTEMPT_TIMEOUT_S)
        try:
            return await js.publish(
                subject, payload, timeout=max(0.1, min(wait, remaining)), headers=dict(headers)
            )
        except TRANSIENT_ERRORS as exc:
            pause = _RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S) - 1)]
            if time.monotonic() + pause >= deadline:
                raise
            attempt += 1
            log.info("publish retried", extra={"subject": subject, "attempt": attempt, "error": repr(exc)})
            await asyncio.sleep(pause)


def _stream_config(spec: StreamSpec, replicas: int = 1) -> jsapi.StreamConfig:
    return jsapi.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=jsapi.RetentionPolicy.WORK_QUEUE
        if spec.retention == "workqueue"
        else jsapi.RetentionPolicy.LIMITS,
        max_age=spec.max_age_s,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=spec.max_msg_size,
        storage=jsapi.StorageType.FILE,
        num_replicas=replicas,
    )


_DELIVER = {
    "all": jsapi.DeliverPolicy.ALL,
    "new": jsapi.DeliverPolicy.NEW,
    "by_start_time": jsapi.DeliverPolicy.BY_START_TIME,
}


def consumer_config(spec: ConsumerSpec) -> jsapi.ConsumerConfig:
    start = None
    if spec.deliver == "by_start_time":
        start = datetime.datetime.fromtimestamp(spec.start_time or 0.0, tz=datetime.UTC)
    return jsapi.ConsumerConfig(
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=jsapi.AckPolicy.EXPLICIT,
        deliver_policy=_DELIVER[spec.deliver],
        opt_start_time=start,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        max_waiting=64,
        inactive_threshold=spec.inactive_threshold_s,
    )


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str = "") -> list[str]:
    """A KV bucket's keys (those under `prefix`, e.g. ``"batch_1."``), asked of the bucket's
    stream in one request.

    Not `KeyValue.keys()`: its watcher decides "no more keys" from a consumer count that can
    say 0 before the first key reaches the client, and then answers "no keys" on a busy
    machine. Deleted keys may be listed (their marker is a message): a reader's `get` says so.
    The server lists up to 100,000 subjects in one answer; every bucket read this way holds
    fewer (a batch has at most 50,000 lines).
    """
    head = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{head}{prefix}>")
    return [subject.removeprefix(head) for subject in info.state.subjects or {}]


class Bus:
    """A service's connection to the mesh. Create with `await Bus.connect(url, name)`.

    `replicas` is how many copies of each stream, KV bucket and object store `provision` asks
    for: 3 on a 3-node cluster, 1 on a single server.
    """

    def __init__(self, nc: NatsClient, service: str, *, replicas: int = 1):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        self.service = service
        self.replicas = replicas
        self.direct = direct_handoff_enabled()
        self._kv: dict[str, KeyValue] = {}
        self._kv_objects: ObjectStore | None = None
        # Fast publishes whose stream ack is awaited in the background (replicated streams).
        self._fast_js: JetStreamContext = nc.jetstream(
            timeout=PUBLISH_TIMEOUT_S, publish_async_max_pending=1 << 16
        )
        self._unacked: deque[_Unacked] = deque()
        # The same, by subject (a request's token subject), so that `flush_fast` finds a
        # request's chunks without a scan of every request's.
        self._unacked_by_subject: dict[str, deque[_Unacked]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._republishing: dict[asyncio.Task[None], _Unacked] = {}

    @classmethod
    async def connect(
        cls,
        url: str,
        service: str,
        *,
        credentials: NatsCredentials | None = None,
        replicas: int = 1,
        connect_timeout_s: float = 5.0,
    ) -> Bus:
        async def on_error(exc: Exception) -> None:
            log.warning("nats error", extra={"error": repr(exc)})

        async def on_disconnect() -> None:
            log.warning("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected")

        nc = await nats.connect(
            nats_servers(url),
            **reconnecting_options(f"ripplemesh-{service}", connect_timeout_s=connect_timeout_s),
            **(credentials.connect_options() if credentials else {}),
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        return cls(nc, service, replicas=replicas)

    # ------------------------------------------------------------ provisioning

    async def provision(
        self,
        streams: Iterable[StreamSpec] = STREAMS,
        buckets: Iterable[KvBucketSpec] = KV_BUCKETS,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        """Create or update every stream and KV bucket; safe to run from every service at once.

        A cluster's JetStream API can be slow to answer while services start together or a
        leader is being elected: transient failures are retried for up to `timeout_s`.
        """
        streams, buckets = list(streams), list(buckets)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._provision(streams, buckets)
                return
            except TRANSIENT_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise
                log.info("provisioning retried", extra={"error": repr(exc)})
                await asyncio.sleep(0.5)

    async def _provision(self, streams: list[StreamSpec], buckets: list[KvBucketSpec]) -> None:
        # Each call answered in milliseconds on a settled cluster; one left unanswered (a node
        # just lost, its meta leader moving) is tried again after 2 s, not a publish's 5 s: a
        # service restarted then is back that much sooner. The calls go out together: a
        # stream without a leader holds up only itself.
        js = self.nc.jetstream(timeout=RETRY_ATTEMPT_TIMEOUT_S)

        async def stream(spec: StreamSpec) -> None:
            config = _stream_config(spec, self.replicas)
            try:
                await js.add_stream(config)
            except BadRequestError:
                # Exists with another configuration (an upgrade): bring it to this spec.
                await js.update_stream(config)

        await asyncio.gather(*(stream(spec) for spec in streams))
        # The buckets made sure of with the short timeout; the KeyValue handles the services
        # keep (self.key_value) wait as long as a publish does.
        await asyncio.gather(*(self._ensure_bucket(bucket, js) for bucket in buckets))
        if self.replicas > 1:
            names = [spec.name for spec in streams] + [f"KV_{bucket.bucket}" for bucket in buckets]
            await self.wait_for_leaders(names)

    async def wait_for_leaders(self, streams: Iterable[str], timeout_s: float = 30.0) -> None:
        """Wait until each replicated stream has elected a leader: until then a publish to it
        finds no responder. A service starts only once its streams can take its events.

        A stream without a leader does not answer at all, so each look waits briefly: the
        service starts within half a second of the election, not a full API timeout later."""
        js = self.nc.jetstream(timeout=LEADER_POLL_S)
        deadline = time.monotonic() + timeout_s

        async def leader(name: str) -> None:
            while True:
                try:
                    info = await js.stream_info(name)
                    if info.cluster is None or info.cluster.leader:
                        return
                except (*TRANSIENT_ERRORS, NotFoundError):  # just created: not known everywhere yet
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stream {name} has no leader after {timeout_s:.0f}s")
                await asyncio.sleep(0.1)

        await asyncio.gather(*(leader(name) for name in streams))

    async def key_value(self, bucket: KvBucketSpec) -> KeyValue:
        kv = self._kv.get(bucket.bucket)
        if kv is None:
            kv = self._kv[bucket.bucket] = await self._ensure_bucket(bucket, self.js)
        return kv

    async def _ensure_bucket(self, bucket: KvBucketSpec, js: JetStreamContext) -> KeyValue:
        try:
            return await js.key_value(bucket.bucket)
        except (NotFoundError, BadRequestError):
            return await js.create_key_value(
                jsapi.KeyValueConfig(
                    bucket=bucket.bucket,
                    description=bucket.description,
                    history=bucket.history,
                    ttl=bucket.ttl_s,
                    replicas=self.replicas,
                )
            )

    async def kv_objects(self) -> ObjectStore:
        """The Object Store bucket that carries KV caches too large for one message."""
        if self._kv_objects is None:
            try:
                self._kv_objects = await self.js.object_store(KV_OBJECTS_BUCKET)
            except BucketNotFoundError:
                self._kv_objects = await self.js.create_object_store(
                    KV_OBJECTS_BUCKET,
                    jsapi.ObjectStoreConfig(
                        description="KV caches in transit from a prefill to a decode worker.",
                        ttl=KV_OBJECTS_TTL_S,
                        replicas=self.replicas,
                    ),
                )
        return self._kv_objects

    async def ensure_consumer(self, spec: ConsumerSpec) -> None:
        try:
            await self.js.add_consumer(spec.stream, consumer_config(spec))
        except BadRequestError as exc:
            # The durable exists with other settings. Recreating it would replay its stream from
            # the start, so keep it (and its position) and say so.
            log.warning(
                "consumer exists with other settings; keeping it",
                extra={"consumer": spec.durable, "stream": spec.stream, "error": str(exc)},
            )

    # ------------------------------------------------------------ publishing

    async def publish(self, subject: str, event: Event, *, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
        """Publish to a stream and wait for its ack, inside a producer span.

        ``Nats-Msg-Id`` is the event's id, so a retried publish is stored once; transient
        failures (a node lost, a leader election) are retried for up to `PUBLISH_RETRY_S`.
        """
        # The producer span is built once the publish is acked (LateSpan): the message does not
        # wait on it; the consumer's span still names it as parent.
        span = LateSpan(
            f"send {subject_family(subject)}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "send",
                "messaging.destination.name": subject,
                "messaging.message.id": event.event_id,
            },
        )
        try:
            # The span's context goes in the headers; nothing here runs under it, so it is not
            # made current (`activate`), which costs as much again.
            headers = span.inject({"Nats-Msg-Id": event.event_id})
            payload = encode_event(event)
            if self.direct and subject.startswith(DIRECT_SOURCES):
                # The consumer may start on this copy; the stored one below stays the record.
                with contextlib.suppress(Exception):
                    await self.nc.publish(direct_subject(subject), payload, headers=headers)
            await publish_acked(self.js, subject, payload, headers, timeout_s=timeout_s)
        except BaseException as exc:
            span.failed(exc)
            raise
        finally:
            span.record()

    async def publish_fast(self, subject: str, event: Event) -> None:
        """Publish without waiting for the stream's ack (token chunks: many, small, ordered by seq).

        The subject is still captured by its stream; the per-request sequence number lets a
        reader detect a gap and read the chunk back from the stream. On replicated streams the
        ack is awaited in the background: a chunk the stream did not store (its leader was lost
        and another not yet elected) is published again, acked, so that a reader who missed it
        can still read it back.
        """
        headers = {"Nats-Msg-Id": event.event_id}
        span = trace.get_current_span()
        if span.get_span_context().is_valid:
            inject_headers(headers)
        payload = encode_event(event)
        if self.replicas == 1:
            await self.nc.publish(subject, payload, headers=headers)
            return
        future = await self._fast_js.publish_async(subject, payload, headers=headers)
        unacked = _Unacked(time.monotonic(), future, subject, payload, headers)
        self._unacked.append(unacked)
        self._unacked_by_subject.setdefault(subject, deque()).append(unacked)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_fast_acks(), name="fast-acks")

    async def _sweep_fast_acks(self) -> None:
        """Check the fast publishes' acks in send order; publish again what was not stored."""
        while True:
            await asyncio.sleep(FAST_ACK_WAIT_S / 4)
            now = time.monotonic()
            while self._unacked:
                head = self._unacked[0]
                if not head.future.done() and now - head.sent_at < FAST_ACK_WAIT_S:
                    break  # the rest were sent later
                self._unacked.popleft()
                self._forget_unacked(head)
                if head.future.done() and not head.future.cancelled() and head.future.exception() is None:
                    continue
                head.future.cancel()  # frees its slot among the pending publishes
                task = asyncio.create_task(self._republish(head), name="fast-republish")
                self._republishing[task] = head
                task.add_done_callback(self._forget_republish)

    def _forget_unacked(self, unacked: _Unacked) -> None:
        # Both queues are in send order: the subject's oldest is the one the sweep took.
        same_subject = self._unacked_by_subject.get(unacked.subject)
        if same_subject:
            same_subject.popleft()
            if not same_subject:
                del self._unacked_by_subject[unacked.subject]

    def _forget_republish(self, task: asyncio.Task[None]) -> None:
        self._republishing.pop(task, None)

    async def flush_fast(self, subject: str, *, retry_s: float = PUBLISH_RETRY_S) -> None:
        """Return once every fast publish to `subject` so far is stored in its stream.

        A worker calls this before it reports a request's work done: once the work is acked,
        nothing would migrate the request, so a chunk that only this process still holds (its
        ack lost with a NATS node) must be stored first, or a kill of this process loses it.
        A chunk whose ack does not come in time is published again, acked (stored once: the
        same ``Nats-Msg-Id``); the last error is raised if that fails for `retry_s`.
        """
        if self.replicas == 1:
            return  # a single server stores a publish before it delivers it
        waiting = list(self._unacked_by_subject.get(subject, ()))
        waiting += [u for u in self._republishing.values() if u.subject == subject]
        if not waiting:
            return
        await asyncio.wait({u.future for u in waiting}, timeout=FAST_ACK_WAIT_S)
        for unacked in waiting:
            future = unacked.future
            if future.done() and not future.cancelled() and future.exception() is None:
                continue
            await publish_acked(self.js, subject, unacked.payload, unacked.headers, retry_s=retry_s)

    async def _republish(self, unacked: _Unacked) -> None:
        try:
            await publish_acked(
                self.js, unacked.subject, unacked.payload, unacked.headers, retry_s=FAST_REPUBLISH_RETRY_S
            )
            log.info("fast publish stored on a retry", extra={"subject": unacked.subject})
        except Exception as exc:
            log.error("fast publish not stored", extra={"subject": unacked.subject, "error": repr(exc)})

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._republishing:
            await asyncio.wait(set(self._republishing), timeout=timeout_s)
            for task in list(self._republishing):
                task.cancel()
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception:  # a drain on a broken connection: close regardless
            await self.nc.close()


@dataclass(frozen=True, slots=True)
class _Unacked:
    sent_at: float
    future: asyncio.Future[jsapi.PubAck]
    subject: str
    payload: bytes
    headers: dict[str, str]
