"""The shared consume loop against a real NATS server: dead-lettering, retries, idempotency."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest

from schemas.events import DeadLetter, RequestRejected, encode_event
from schemas.subjects import DLQ, ConsumerSpec, StreamSpec, dlq_subject
from services.mesh.bus import Bus
from services.mesh.consumer import Consumer, Delivery, PermanentError


def _event(event_id: str | None = None) -> RequestRejected:
    return RequestRejected(
        event_id=event_id or uuid.uuid4().hex,
        occurred_at=time.time(),
        request_id="r1",
        tenant="acme",
        stage="admission",
        reason="quota",
        message="test",
    )


@pytest.fixture
async def stream(bus: Bus) -> tuple[StreamSpec, ConsumerSpec]:
    name = f"T{uuid.uuid4().hex[:10].upper()}"
    spec = StreamSpec(
        name=name,
        subjects=[f"test.{name}.>"],
        retention="workqueue",
        max_age_s=600,
        description="test stream",
    )
    await bus.provision([spec], [])
    consumer = ConsumerSpec(
        durable="c",
        stream=name,
        filter_subject=f"test.{name}.>",
        max_deliver=3,
        backoff_s=(0.05,),
        ack_wait_s=5,
    )
    return spec, consumer


async def _dead_letters(bus: Bus, stream: str, expected: int, timeout_s: float = 10) -> list[DeadLetter]:
    """Read this test stream's dead letters back from the DLQ stream."""
    deadline = time.monotonic() + timeout_s
    while True:
        sub = await bus.js.subscribe(dlq_subject(stream), stream=DLQ.name, ordered_consumer=True)
        letters = []
        try:
            while True:
                msg = await sub.next_msg(timeout=0.3)
                letters.append(msgspec.json.decode(msg.data, type=DeadLetter))
        except TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        if len(letters) >= expected or time.monotonic() > deadline:
            return letters
        await asyncio.sleep(0.1)


async def test_malformed_message_is_dead_lettered_and_the_consumer_goes_on(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    handled: list[str] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        handled.append(event.event_id)

    consumer = Consumer(bus, consumer_spec, RequestRejected, handler)
    await consumer.start()
    try:
        await bus.js.publish(f"test.{spec.name}.a", b"{not json")
        await bus.js.publish(f"test.{spec.name}.a", b'{"type": "request.rejected.v1", "event_id": "x"}')
        good = _event()
        await bus.js.publish(f"test.{spec.name}.a", encode_event(good))
        letters = await _dead_letters(bus, spec.name, 2)
        assert len(letters) == 2
        assert all(letter.reason.startswith("undecodable") for letter in letters)
        assert letters[0].data == b"{not json"
        assert "occurred_at" in letters[1].reason  # names the missing field
        for _ in range(50):
            if handled:
                break
            await asyncio.sleep(0.1)
        assert handled == [good.event_id]
    finally:
        await consumer.stop()


async def test_transient_failure_is_retried_and_handled_once(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    attempts: list[int] = []
    effects: list[str] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        attempts.append(delivery.num_delivered)
        if delivery.num_delivered < 2:
            raise ConnectionError("transient")
        effects.append(event.event_id)

    consumer = Consumer(bus, consumer_spec, RequestRejected, handler)
    await consumer.start()
    try:
        event = _event()
        await bus.js.publish(f"test.{spec.name}.a", encode_event(event))
        for _ in range(100):
            if effects:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert attempts == [1, 2]
        assert effects == [event.event_id]
    finally:
        await consumer.stop()


async def test_failures_past_max_deliver_and_permanent_errors_are_dead_lettered(bus: Bus, stream) -> None:
    spec, consumer_spec = stream

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        if event.message == "permanent":
            raise PermanentError("cannot ever be processed")
        raise RuntimeError("always broken")

    consumer = Consumer(bus, consumer_spec, RequestRejected, handler)
    await consumer.start()
    try:
        await bus.js.publish(f"test.{spec.name}.a", encode_event(_event()))
        permanent = msgspec.structs.replace(_event(), message="permanent")
        await bus.js.publish(f"test.{spec.name}.a", encode_event(permanent))
        letters = await _dead_letters(bus, spec.name, 2)
        reasons = sorted(letter.reason for letter in letters)
        assert len(reasons) == 2
        assert reasons[0].startswith("failed after 3 deliveries") and "always broken" in reasons[0]
        assert reasons[1].startswith("rejected by handler: cannot ever be processed")
    finally:
        await consumer.stop()


async def test_a_redelivered_event_id_is_processed_once(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    effects: list[str] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        effects.append(event.event_id)

    consumer = Consumer(bus, consumer_spec, RequestRejected, handler)
    await consumer.start()
    try:
        event = _event()
        # Two copies that JetStream stores separately (different message ids), same event id.
        for copy in range(2):
            await bus.js.publish(
                f"test.{spec.name}.a",
                encode_event(event),
                headers={"Nats-Msg-Id": f"{event.event_id}-{copy}"},
            )
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.3)
        assert effects == [event.event_id]
        info = await bus.js.stream_info(spec.name)
        assert info.state.messages == 0  # both acked off the work queue
    finally:
        await consumer.stop()
