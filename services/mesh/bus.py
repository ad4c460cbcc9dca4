"""The bus: one NATS connection per service, stream provisioning, traced publishing."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import nats
import nats.js.api as jsapi
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
from services.mesh.tracing import inject_headers, subject_family, tracer

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 5.0


def nats_servers(url: str) -> list[str]:
    """A NATS URL may be a comma-separated list of cluster nodes; any of them will do."""
    return [part.strip() for part in url.split(",") if part.strip()]


def _stream_config(spec: StreamSpec) -> jsapi.StreamConfig:
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
        num_replicas=1,
    )


def consumer_config(spec: ConsumerSpec) -> jsapi.ConsumerConfig:
    return jsapi.ConsumerConfig(
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=jsapi.AckPolicy.EXPLICIT,
        deliver_policy=jsapi.DeliverPolicy.ALL,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        max_waiting=64,
        inactive_threshold=spec.inactive_threshold_s,
    )


class Bus:
    """A service's connection to the mesh. Create with `await Bus.connect(url, name)`."""

    def __init__(self, nc: NatsClient, service: str):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        self.service = service
        self._kv: dict[str, KeyValue] = {}
        self._kv_objects: ObjectStore | None = None

    @classmethod
    async def connect(cls, url: str, service: str, *, connect_timeout_s: float = 5.0) -> Bus:
        async def on_error(exc: Exception) -> None:
            log.warning("nats error", extra={"error": repr(exc)})

        async def on_disconnect() -> None:
            log.warning("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected")

        nc = await nats.connect(
            nats_servers(url),
            name=f"ripplemesh-{service}",
            connect_timeout=connect_timeout_s,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            pending_size=64 * 1024 * 1024,
        )
        return cls(nc, service)

    # ------------------------------------------------------------ provisioning

    async def provision(
        self,
        streams: Iterable[StreamSpec] = STREAMS,
        buckets: Iterable[KvBucketSpec] = KV_BUCKETS,
    ) -> None:
        """Create or update every stream and KV bucket; safe to run from every service at once."""
        for spec in streams:
            config = _stream_config(spec)
            try:
                await self.js.add_stream(config)
            except BadRequestError:
                # Exists with another configuration (an upgrade): bring it to this spec.
                await self.js.update_stream(config)
        for bucket in buckets:
            await self.key_value(bucket)

    async def key_value(self, bucket: KvBucketSpec) -> KeyValue:
        kv = self._kv.get(bucket.bucket)
        if kv is None:
            try:
                kv = await self.js.key_value(bucket.bucket)
            except (NotFoundError, BadRequestError):
                kv = await self.js.create_key_value(
                    jsapi.KeyValueConfig(
                        bucket=bucket.bucket,
                        description=bucket.description,
                        history=bucket.history,
                        ttl=bucket.ttl_s,
                    )
                )
            self._kv[bucket.bucket] = kv
        return kv

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

        ``Nats-Msg-Id`` is the event's id, so a retried publish is stored once.
        """
        with tracer().start_as_current_span(
            f"send {subject_family(subject)}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "send",
                "messaging.destination.name": subject,
                "messaging.message.id": event.event_id,
            },
        ):
            headers = inject_headers({"Nats-Msg-Id": event.event_id})
            await self.js.publish(subject, encode_event(event), timeout=timeout_s, headers=headers)

    async def publish_fast(self, subject: str, event: Event) -> None:
        """Publish without waiting for the stream's ack (token chunks: many, small, ordered by seq).

        The subject is still captured by its stream; the per-request sequence number lets a
        reader detect a gap and read the chunk back from the stream.
        """
        headers = {"Nats-Msg-Id": event.event_id}
        span = trace.get_current_span()
        if span.get_span_context().is_valid:
            inject_headers(headers)
        await self.nc.publish(subject, encode_event(event), headers=headers)

    async def close(self, timeout_s: float = 5.0) -> None:
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception:  # a drain on a broken connection: close regardless
            await self.nc.close()
