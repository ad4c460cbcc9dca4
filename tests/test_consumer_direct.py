"""The consume loop's direct hand-off against a real NATS server: the handler starts from the
publish heard on core NATS, the stored copy is acked after it (or retried when it failed, or
redelivered when the process died), and replicas of one durable never both handle an event."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from schemas.events import RequestRejected
from schemas.subjects import ConsumerSpec, StreamSpec
from services.mesh import consumer as consumer_module
from services.mesh.bus import Bus
from services.mesh.consumer import Consumer, Delivery


def _event() -> RequestRejected:
    return RequestRejected(
        event_id=uuid.uuid4().hex,
        occurred_at=time.time(),
        request_id="r1",
        tenant="acme",
        stage="admission",
        reason="quota",
        message="test",
    )


@pytest.fixture(autouse=True)
def quick_presence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumer_module, "LISTEN_BEFORE_DIRECT_S", 0.5)
    monkeypatch.setattr(consumer_module, "PRESENCE_EVERY_S", 0.2)


@pytest.fixture
async def stream(bus: Bus) -> tuple[StreamSpec, ConsumerSpec]:
    name = f"D{uuid.uuid4().hex[:10].upper()}"
    spec = StreamSpec(
        name=name, subjects=[f"test.{name}.>"], retention="workqueue", max_age_s=600, description="test"
    )
    await bus.provision([spec], [])
    consumer = ConsumerSpec(
        durable="c",
        stream=name,
        filter_subject=f"test.{name}.>",
        max_deliver=3,
        backoff_s=(0.05,),
        ack_wait_s=2,
    )
    return spec, consumer


async def _until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def _stored(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.messages


async def _drained(bus: Bus, stream: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await _stored(bus, stream):
        if time.monotonic() > deadline:
            raise AssertionError("stored copies left unacked")
        await asyncio.sleep(0.05)


async def test_direct_handler_runs_once_and_the_stored_copy_is_acked(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    handled: list[tuple[str, int]] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        await asyncio.sleep(0.3)  # still running when the stored copy is delivered
        handled.append((event.event_id, delivery.stream_seq))

    consumer = Consumer(bus, consumer_spec, RequestRejected, handler, fast_path=True)
    await consumer.start()
    try:
        await asyncio.sleep(0.7)
        events = [_event() for _ in range(20)]
        for event in events:
            await bus.publish(f"test.{spec.name}.a", event)
        await _until(lambda: len(handled) >= 20)
        await _drained(bus, spec.name)
        await asyncio.sleep(0.3)
        assert sorted(e for e, _ in handled) == sorted(e.event_id for e in events)
        # Taken directly (no stream sequence), bar the odd one a loaded machine sends down the
        # stored path, which the consumer allows (each event still runs once, above). CI saw
        # one such run; which way that event went there was not found out.
        assert sum(seq == 0 for _, seq in handled) >= 15
    finally:
        await consumer.stop()


async def test_a_failed_direct_handler_is_retried_from_the_stored_copy(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    attempts: list[int] = []
    effects: list[str] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        attempts.append(delivery.stream_seq)
        if len(attempts) == 1:
            raise ConnectionError("transient")
        effects.append(event.event_id)

    consumer = Consumer(bus, consumer_spec, RequestRejected, handler, fast_path=True)
    await consumer.start()
    try:
        await asyncio.sleep(0.7)
        event = _event()
        await bus.publish(f"test.{spec.name}.a", event)
        await _until(lambda: bool(effects))
        await _drained(bus, spec.name)
        assert effects == [event.event_id]
        assert attempts[0] == 0 and attempts[1] > 0  # direct, then the stored copy
    finally:
        await consumer.stop()


async def test_a_direct_handler_lost_with_its_process_is_redelivered(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    first: list[str] = []

    async def stuck(event: RequestRejected, delivery: Delivery) -> None:
        first.append(event.event_id)
        await asyncio.Event().wait()

    consumer = Consumer(bus, consumer_spec, RequestRejected, stuck, fast_path=True)
    await consumer.start()
    event = _event()
    try:
        await asyncio.sleep(0.7)
        await bus.publish(f"test.{spec.name}.a", event)
        await _until(lambda: bool(first))
    finally:
        await consumer.stop(grace_s=0.1)  # cancels the handler: as if the process died
    assert first == [event.event_id]
    assert await _stored(bus, spec.name) == 1

    again: list[str] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        again.append(event.event_id)

    successor = Consumer(bus, consumer_spec, RequestRejected, handler, fast_path=True)
    await successor.start()
    try:
        await _until(lambda: bool(again), timeout_s=15)
        await _drained(bus, spec.name)
        assert again == [event.event_id]
    finally:
        await successor.stop()


async def test_replicas_hear_each_other_and_handle_each_event_once(bus: Bus, stream) -> None:
    spec, consumer_spec = stream
    handled: list[tuple[str, int]] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        await asyncio.sleep(0.01)
        handled.append((event.event_id, delivery.stream_seq))

    replicas = [Consumer(bus, consumer_spec, RequestRejected, handler, fast_path=True) for _ in range(2)]
    for replica in replicas:
        await replica.start()
    try:
        await asyncio.sleep(0.8)
        events = [_event() for _ in range(60)]
        for event in events:
            await bus.publish(f"test.{spec.name}.a", event)
        await _until(lambda: len(handled) >= 60)
        await _drained(bus, spec.name)
        await asyncio.sleep(0.5)
        assert sorted(e for e, _ in handled) == sorted(e.event_id for e in events)  # once each
        assert all(seq > 0 for _, seq in handled)  # no direct hand-off among replicas
    finally:
        for replica in replicas:
            await replica.stop()


async def test_mesh_subjects_hand_off_on_the_direct_subject(bus: Bus) -> None:
    # A subject the mesh's publishers send a direct copy of (bus.py: rmesh.work.*): the
    # consumer takes that copy, with the stream's subject, and acks the stored one.
    worker = f"t{uuid.uuid4().hex[:10]}"
    subject = f"rmesh.work.prefill.{worker}"
    spec = ConsumerSpec(
        durable=f"direct-{worker}", stream="WORK", filter_subject=subject, max_deliver=3, ack_wait_s=2
    )
    handled: list[tuple[str, str, int]] = []

    async def handler(event: RequestRejected, delivery: Delivery) -> None:
        handled.append((event.event_id, delivery.subject, delivery.stream_seq))

    bus.direct = True  # as with RIPPLEMESH_DIRECT_HANDOFF=1: publishes send the direct copy
    consumer = Consumer(bus, spec, RequestRejected, handler, fast_path=True)
    await consumer.start()
    try:
        await asyncio.sleep(0.7)
        event = _event()
        await bus.publish(subject, event)
        await _until(lambda: bool(handled))

        async def settled() -> bool:
            info = await bus.js.consumer_info("WORK", spec.durable)
            return not info.num_pending and not info.num_ack_pending

        deadline = time.monotonic() + 10
        while not await settled():
            assert time.monotonic() < deadline, "the stored copy was not acked"
            await asyncio.sleep(0.05)
        assert handled == [(event.event_id, subject, 0)]
    finally:
        await consumer.stop()
        await bus.js.delete_consumer("WORK", spec.durable)
