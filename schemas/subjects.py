"""Subject names, streams, KV buckets and consumers: defined once, provisioned by every service.

A tenant's name is part of its request and token subjects so that NATS permissions can confine
a tenant to its own traffic.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.events import PriorityClass, WorkerRole

PREFIX = "rmesh"


def request_subject(tenant: str) -> str:
    """Where clients submit requests (`SubmitRequest`)."""
    return f"{PREFIX}.req.{tenant}"


def prepared_subject(tenant: str) -> str:
    """Validated, tokenized requests (`RequestPrepared`), for admission."""
    return f"{PREFIX}.prepared.{tenant}"


def admitted_subject(priority: PriorityClass) -> str:
    return f"{PREFIX}.admitted.{priority}"


def work_subject(role: WorkerRole, worker_id: str) -> str:
    return f"{PREFIX}.work.{role}.{worker_id}"


def tokens_subject(tenant: str, request_id: str) -> str:
    return f"{PREFIX}.tokens.{tenant}.{request_id}"


def tenant_tokens_filter(tenant: str) -> str:
    """Every token subject of one tenant: what its NATS user may subscribe to."""
    return f"{PREFIX}.tokens.{tenant}.>"


def tenant_inbox_prefix(tenant: str) -> str:
    """A tenant client's inbox prefix, so that its user may read its own replies and no one else's."""
    return f"_INBOX_{tenant}"


def event_subject(kind: str) -> str:
    return f"{PREFIX}.events.{kind}"


def dlq_subject(stream: str) -> str:
    return f"{PREFIX}.dlq.{stream}"


def kv_subject(worker_id: str) -> str:
    """A worker's prefix-cache changes (`KvEvents`), core NATS."""
    return f"{PREFIX}.kv.{worker_id}"


def kv_dump_subject(worker_id: str) -> str:
    """Request/reply: a worker's full prefix-cache contents (`KvDump`)."""
    return f"{PREFIX}.kv.{worker_id}.dump"


def control_subject(worker_id: str) -> str:
    """Orders to one worker (`WorkerControl`: drain, revoke, ping), core NATS request/reply."""
    return f"{PREFIX}.control.{worker_id}"


# `ripplemesh up --autoscale`'s process supervisor: `ScaleOrder` in, `LauncherFleet` back.
LAUNCHER_SUBJECT = f"{PREFIX}.control.launcher"


def tenant_of(subject: str) -> str:
    """The tenant token of a request or token subject (``rmesh.req.<tenant>``...)."""
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != PREFIX:
        raise ValueError(f"not a ripplemesh tenant subject: {subject!r}")
    return parts[2]


# Every lifecycle event's subject kind, by event tag, so producers never spell it twice.
EVENT_KINDS: dict[str, str] = {
    "request.rejected.v1": "rejected",
    "admission.decision.v1": "admission",
    "request.routed.v1": "routed",
    "router.decision.v1": "route_decision",
    "request.prefill_completed.v1": "prefill_completed",
    "request.decode_completed.v1": "decode_completed",
    "request.failed.v1": "failed",
    "request.cancelled.v1": "cancelled",
    "request.migrated.v1": "migrated",
    "request.work_stopped.v1": "work_stopped",
    "fleet.observed.v1": "fleet",
    "autoscaler.decision.v1": "scaling",
    "capacity.wanted.v1": "capacity",
}


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: list[str]
    retention: Literal["limits", "workqueue"]
    max_age_s: float
    description: str
    duplicate_window_s: float = 120.0
    max_msg_size: int = 1024 * 1024


class KvBucketSpec(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    ttl_s: float
    description: str
    history: int = 1


class ConsumerSpec(msgspec.Struct, frozen=True, kw_only=True):
    durable: str
    stream: str
    filter_subject: str
    # A delivery lost with a NATS node (or a dead process) comes back after this long. A handler
    # that runs longer keeps its message by reporting progress every ack_wait/3.
    ack_wait_s: float = 10.0
    max_deliver: int = 5
    # Redelivery delays after a nak, by attempt; the last repeats.
    backoff_s: tuple[float, ...] = (0.1, 0.5, 2.0, 5.0)
    max_ack_pending: int = 1024
    # Durable consumers of workers that vanish for good are removed by the server after this.
    inactive_threshold_s: float | None = None
    # Where a new consumer starts in its stream: every message kept ("all"), only those
    # published from now ("new"), or those from `start_time` (seconds since the epoch) on.
    deliver: Literal["all", "new", "by_start_time"] = "all"
    start_time: float | None = None


REQUESTS = StreamSpec(
    name="REQUESTS",
    subjects=[f"{PREFIX}.req.*", f"{PREFIX}.prepared.*"],
    retention="limits",
    max_age_s=24 * 3600,
    description="Submitted requests (what clients publish) and their prepared, tokenized form.",
)
ADMITTED = StreamSpec(
    name="ADMITTED",
    subjects=[f"{PREFIX}.admitted.*"],
    retention="workqueue",
    max_age_s=3600,
    description="Admitted requests waiting for the router, by priority class.",
)
WORK = StreamSpec(
    name="WORK",
    subjects=[f"{PREFIX}.work.>"],
    retention="workqueue",
    max_age_s=3600,
    description="Placed work for one worker: prefill (or aggregated) and decode.",
)
TOKENS = StreamSpec(
    name="TOKENS",
    subjects=[f"{PREFIX}.tokens.>"],
    retention="limits",
    max_age_s=600,
    description="Token chunks per request, with a per-request sequence number, kept briefly "
    "so a client can resume a stream.",
)
LIFECYCLE = StreamSpec(
    name="LIFECYCLE",
    subjects=[f"{PREFIX}.events.>"],
    retention="limits",
    max_age_s=7 * 24 * 3600,
    description="Every lifecycle and decision event: the ledger's source and the audit log.",
)
DLQ = StreamSpec(
    name="DLQ",
    subjects=[f"{PREFIX}.dlq.>"],
    retention="limits",
    max_age_s=7 * 24 * 3600,
    description="Messages that could not be decoded or processed, with the reason.",
)
STREAMS: tuple[StreamSpec, ...] = (REQUESTS, ADMITTED, WORK, TOKENS, LIFECYCLE, DLQ)

WORKERS = KvBucketSpec(
    bucket="WORKERS",
    ttl_s=10.0,
    description="Each worker's latest WorkerState; an entry expires when heartbeats stop.",
)
WORKFLOW_SPEND = KvBucketSpec(
    bucket="WORKFLOW_SPEND",
    ttl_s=3600.0,
    description="Each workflow's running spend (WorkflowSpend), keyed by workflow id, put by the "
    "ledger after each batch that touches it; an entry expires an hour after its last update.",
)
ADMISSION_QUOTAS = KvBucketSpec(
    bucket="ADMISSION_QUOTAS",
    ttl_s=3600.0,
    description="Each tenant's quota state (token bucket levels and concurrency leases), keyed by "
    "tenant, shared by the admission replicas with compare-and-set; an entry expires an hour after "
    "its tenant's last request (its buckets are full again by then).",
)
TENANT_THROTTLES = KvBucketSpec(
    bucket="TENANT_THROTTLES",
    ttl_s=7 * 24 * 3600.0,
    description="Tenants whose new requests admission refuses until a time (TenantThrottle), keyed "
    "by tenant: the control subject a subscriber closes a loop through (a budget guard).",
)
KV_BUCKETS: tuple[KvBucketSpec, ...] = (WORKERS, WORKFLOW_SPEND, ADMISSION_QUOTAS, TENANT_THROTTLES)

# JetStream Object Store bucket for KV caches too large for one message (hf engine hand-off);
# only the object's name travels on the bus, in `KvHandle.object_name`.
KV_OBJECTS_BUCKET = "RMESH_KV"
KV_OBJECTS_TTL_S = 600.0

INGRESS_CONSUMER = ConsumerSpec(durable="ingress", stream="REQUESTS", filter_subject=f"{PREFIX}.req.*")
# A deferred request holds its message until admission decides it, so the replicas' deferral
# queues together (AdmissionLimits.max_deferred, 4,096 each, plus the requests in hand) must fit
# under max_ack_pending, or the server stops delivering new requests to any replica. The mesh's
# config refuses a max_deferred whose one queue does not fit (services/mesh/config.py).
ADMISSION_CONSUMER = ConsumerSpec(
    durable="admission", stream="REQUESTS", filter_subject=f"{PREFIX}.prepared.*", max_ack_pending=16384
)
ROUTER_CONSUMER = ConsumerSpec(durable="router", stream="ADMITTED", filter_subject=f"{PREFIX}.admitted.*")
LEDGER_CONSUMER = ConsumerSpec(
    durable="ledger",
    stream="LIFECYCLE",
    filter_subject=f"{PREFIX}.events.>",
    max_ack_pending=4096,
    ack_wait_s=5.0,
)


def worker_consumer(role: WorkerRole, worker_id: str) -> ConsumerSpec:
    return ConsumerSpec(
        durable=f"worker-{role}-{worker_id}",
        stream="WORK",
        filter_subject=work_subject(role, worker_id),
        # A decode handler holds its message for the whole generation; it reports progress
        # every ack_wait/3 so a live worker's work is never redelivered.
        ack_wait_s=15.0,
        max_deliver=3,
        inactive_threshold_s=3600.0,
    )
