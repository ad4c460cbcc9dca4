"""The ingress's NATS submit path: `SubmitRequest`s consumed from ``rmesh.req.<tenant>`` (the
tenant is the subject's) and prepared as HTTP requests are; the client reads its tokens from
``rmesh.tokens.<tenant>.<request_id>``. Also the tenant's `ReplayTokens` (token events it missed,
published again) and `CancelRequest`s."""

from __future__ import annotations

import logging
import time

import msgspec
from prometheus_client import Counter

from schemas.events import (
    CancelRequest,
    ClientEvent,
    Identifier,
    ReplayTokens,
    RequestPrepared,
    SubmitRequest,
    derived_event_id,
)
from schemas.subjects import event_subject, prepared_subject, tenant_of, tokens_subject
from services.ingress.cancel import cancelled
from services.ingress.part import ServicePart
from services.ingress.prepare import ClientRequest, InvalidRequest, prepare
from services.mesh.consumer import Delivery
from services.mesh.rejection import publish_rejection
from services.mesh.token_stream import stored_messages

# The service's logger: its records are named as before the module was split out.
log = logging.getLogger("services.ingress.service")

NATS_SUBMISSIONS = Counter(
    "ripplemesh_ingress_nats_submissions_total",
    "Requests submitted over NATS, by outcome.",
    ["outcome"],
)
REPLAYED_EVENTS = Counter(
    "ripplemesh_ingress_replayed_token_events_total",
    "Token events published again for NATS clients that missed them (ReplayTokens).",
)

SUBMIT_TAG: str = SubmitRequest.__struct_config__.tag  # type: ignore[assignment]


class _SubmissionIds(msgspec.Struct):
    """What can still be read of a submission that does not decode: enough to answer it."""

    type: str = ""
    request_id: Identifier | None = None
    event_id: Identifier | None = None


class _Sequenced(msgspec.Struct):
    """Just the sequence number of a token event."""

    seq: int


class NatsPath(ServicePart):
    """The handlers of the ingress consumer's client events."""

    async def on_client_event(self, event: ClientEvent, delivery: Delivery) -> None:
        if isinstance(event, SubmitRequest):
            await self._on_submission(event, delivery)
        elif isinstance(event, ReplayTokens):
            await self._on_replay(event, delivery)
        elif isinstance(event, CancelRequest):
            await self._on_cancel(event, delivery)
        else:
            log.info("client event not handled here", extra={"type": type(event).__name__})

    async def _on_replay(self, replay: ReplayTokens, delivery: Delivery) -> None:
        """Publish again the request's stored token events from `from_seq` on, with their own
        message ids (the TOKENS stream drops them as duplicates; the client's subscription gets
        them). The tenant is the subject's, so a tenant replays only its own streams."""
        subject = tokens_subject(tenant_of(delivery.subject), replay.request_id)
        replayed = 0
        for msg in await stored_messages(self._rt.bus.nc, subject):
            try:
                seq = msgspec.json.decode(msg.data, type=_Sequenced).seq
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if seq >= replay.from_seq:
                msg_id = (msg.headers or {}).get("Nats-Msg-Id")
                await self._rt.bus.nc.publish(
                    subject, msg.data, headers={"Nats-Msg-Id": msg_id} if msg_id else None
                )
                replayed += 1
        REPLAYED_EVENTS.inc(replayed)

    async def _on_cancel(self, cancel: CancelRequest, delivery: Delivery) -> None:
        """A NATS client cancels one of its requests: the tenant is the subject's, and workers
        stop the request only if it is that tenant's."""
        tenant = tenant_of(delivery.subject)
        if tenant not in self._rt.config.tenants:
            log.warning("cancellation for an unknown tenant ignored", extra={"tenant": tenant})
            return
        await self._rt.bus.publish(
            event_subject("cancelled"),
            cancelled(cancel.request_id, tenant, "client_cancelled", source_event_id=cancel.event_id),
        )

    async def _on_submission(self, submission: SubmitRequest, delivery: Delivery) -> None:
        tenant = tenant_of(delivery.subject)
        try:
            if tenant not in self._rt.config.tenants:
                raise InvalidRequest(f"unknown tenant {tenant!r}", status=403, code="unknown_tenant")
            prepared = prepare(
                ClientRequest(
                    request_id=submission.request_id,
                    tenant=tenant,
                    model=submission.model,
                    api="nats",
                    prompt=submission.prompt,
                    messages=submission.messages,
                    max_tokens=submission.max_tokens,
                    temperature=submission.temperature,
                    priority=submission.priority,
                    priority_level=submission.priority_level,
                    deadline_ms=submission.deadline_ms,
                    workflow=submission.workflow,
                    tools=submission.tools,
                    tool_choice=submission.tool_choice,
                    response_format=submission.response_format,
                    logprobs=submission.logprobs,
                    service_class=submission.service_class,
                ),
                self._rt.config,
                submission.occurred_at or time.time(),
                self.fleet.features(self._rt.config.base_model_name(submission.model), time.time()),
            )
        except InvalidRequest as exc:
            NATS_SUBMISSIONS.labels("invalid").inc()
            await self._reject_submission(submission, tenant, exc)
            return
        await self._rt.bus.publish(
            prepared_subject(tenant),
            RequestPrepared(
                event_id=derived_event_id(submission.event_id, "prepared"),
                occurred_at=time.time(),
                request=prepared,
            ),
        )
        NATS_SUBMISSIONS.labels("accepted").inc()

    async def on_undecodable_submission(self, delivery: Delivery, data: bytes, reason: str) -> None:
        """A submission that breaks the schema (a priority not in the three classes, a negative
        max_tokens) is dead-lettered by the consumer; if its request id can still be read, its
        client is also told why on the request's token subject, instead of waiting in vain."""
        try:
            ids = msgspec.json.decode(data, type=_SubmissionIds)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # nobody to answer: the dead letter alone records it
        tenant = tenant_of(delivery.subject)
        if ids.type != SUBMIT_TAG or ids.request_id is None or tenant not in self._rt.config.tenants:
            return
        NATS_SUBMISSIONS.labels("invalid").inc()
        await publish_rejection(
            self._rt.bus,
            source_event_id=ids.event_id or f"{delivery.subject}:{delivery.stream_seq}",
            request_id=ids.request_id,
            tenant=tenant,
            stage="ingress",
            reason="invalid",
            message=f"invalid submission: {reason}",
            http_status=400,
        )

    async def _reject_submission(self, submission: SubmitRequest, tenant: str, exc: InvalidRequest) -> None:
        await publish_rejection(
            self._rt.bus,
            source_event_id=submission.event_id,
            request_id=submission.request_id,
            tenant=tenant,
            stage="ingress",
            reason="invalid",
            message=exc.message,
            http_status=exc.status,
            service_class=submission.service_class,
        )
