"""The subscriber SDK (ripplemesh/subscriber.py) on the real NATS: typed events in, at-least-once,
dead letters with the reason, durable positions, `ripplemesh run-subscriber`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from examples.cache_alerts import CacheWatch
from ripplemesh import Context, Subscriber
from schemas.events import DeadLetter, PrefillCompleted, RequestFailed, new_event_id
from schemas.subjects import DLQ, LIFECYCLE, dlq_subject, event_subject
from services.mesh.bus import Bus
from services.mesh.embedded_nats import EmbeddedNats


def prefill(cached: int, prompt: int = 1000, gpu: str = "H100") -> PrefillCompleted:
    return PrefillCompleted(
        event_id=new_event_id(),
        occurred_at=time.time(),
        request_id=f"r-{uuid.uuid4().hex[:8]}",
        tenant="demo",
        worker_id="prefill-0",
        gpu_type=gpu,
        gpu_seconds=0.01,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_s=0.1,
    )


def failed(message: str = "boom") -> RequestFailed:
    return RequestFailed(
        event_id=new_event_id(),
        occurred_at=time.time(),
        request_id=f"r-{uuid.uuid4().hex[:8]}",
        tenant="demo",
        stage="decode",
        message=message,
    )


async def until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.05)


async def dead_letters(bus: Bus, consumer: str, expected: int, timeout_s: float = 15.0) -> list[DeadLetter]:
    deadline = time.monotonic() + timeout_s
    while True:
        sub = await bus.js.subscribe(dlq_subject(LIFECYCLE.name), stream=DLQ.name, ordered_consumer=True)
        letters = []
        try:
            while True:
                msg = await sub.next_msg(timeout=0.3)
                letter = msgspec.json.decode(msg.data, type=DeadLetter)
                if letter.consumer == consumer:
                    letters.append(letter)
        except TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        if len(letters) >= expected or time.monotonic() > deadline:
            return letters
        await asyncio.sleep(0.2)


def name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


async def test_a_handler_gets_the_typed_events_it_asked_for_and_no_others(bus: Bus) -> None:
    watch = CacheWatch(window=4, threshold=0.5)
    seen: list[tuple[str, str]] = []
    sub = Subscriber(name())

    @sub.on(PrefillCompleted)
    async def prefilled(event: PrefillCompleted, context: Context) -> None:
        seen.append((type(event).__name__, context.event_id))
        watch.observe(event.gpu_type, event.prompt_tokens, event.cached_tokens)

    await sub.start(bus)
    try:
        events = [prefill(900), prefill(800), prefill(100), prefill(50), prefill(0), prefill(0)]
        await bus.publish(event_subject("failed"), failed())  # not asked for: skipped
        for event in events:
            await bus.publish(event_subject("prefill_completed"), event)
        await until(lambda: len(seen) == len(events))
        assert [event_id for _, event_id in seen] == [e.event_id for e in events]
        # The first full window (1,850 of 4,000 cached) is below 0.5: one alert, not one a prefill.
        assert watch.alerts == [("H100", pytest.approx(1850 / 4000))]
    finally:
        await sub.stop()


async def test_a_bad_message_or_a_failing_handler_is_dead_lettered_with_its_reason_and_the_rest_go_on(
    bus: Bus,
) -> None:
    handled: list[str] = []
    sub = Subscriber(name(), handler_timeout_s=0.5, max_deliver=2, retry_backoff_s=(0.05,))

    @sub.on(RequestFailed)
    async def on_failed(event: RequestFailed, context: Context) -> None:
        if event.message == "raise":
            raise ValueError("cannot handle this one")
        if event.message == "hang":
            await asyncio.sleep(60)
        handled.append(event.message)

    await sub.start(bus)
    try:
        # A plain publish on a stream's subject is stored too: both reach the subscriber.
        await bus.nc.publish(event_subject("failed"), b"{not json")
        await bus.js.publish(event_subject("failed"), b'{"type": "request.failed.v1", "event_id": 7}')
        for message in ("raise", "hang", "fine"):
            await bus.publish(event_subject("failed"), failed(message))
        letters = await dead_letters(bus, sub.spec().durable, 4)
        reasons = sorted(letter.reason for letter in letters)
        assert len(reasons) == 4, reasons
        assert any("ValueError" in r and "cannot handle this one" in r for r in reasons)
        assert any("ran past 0.5 s" in r for r in reasons), reasons
        assert sum(1 for r in reasons if "ValueError" not in r and "ran past" not in r) == 2, reasons
        await until(lambda: handled == ["fine"])
    finally:
        await sub.stop()


async def test_a_durable_subscriber_goes_on_where_it_stopped_and_start_from_picks_the_beginning(
    bus: Bus,
) -> None:
    durable = name()
    got: list[str] = []

    def subscriber(start_from: str = "new") -> Subscriber:
        sub = Subscriber(durable, start_from=start_from)  # type: ignore[arg-type]

        @sub.on(RequestFailed)
        async def on_failed(event: RequestFailed, context: Context) -> None:
            if event.message.startswith(durable):
                got.append(event.message)

        return sub

    first = subscriber()
    await first.start(bus)
    await bus.publish(event_subject("failed"), failed(f"{durable}-1"))
    await until(lambda: got == [f"{durable}-1"])
    await first.stop()
    await bus.publish(event_subject("failed"), failed(f"{durable}-2"))  # while it is away
    again = subscriber()
    await again.start(bus)
    try:
        await until(lambda: got == [f"{durable}-1", f"{durable}-2"])
    finally:
        await again.stop()
    # A new subscriber from "all" reads what the stream keeps, ours included.
    everything: list[str] = []
    replay = Subscriber(name(), start_from="all")

    @replay.on(RequestFailed)
    async def on_any(event: RequestFailed, context: Context) -> None:
        if event.message.startswith(durable):
            everything.append(event.message)

    await replay.start(bus)
    try:
        await until(lambda: sorted(everything) == [f"{durable}-1", f"{durable}-2"])
    finally:
        await replay.stop()


def test_run_subscriber_joins_the_mesh_with_the_example_and_stops_on_sigterm(
    nats_server: EmbeddedNats, nats_credentials: dict[str, Path]
) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ripplemesh",
            "run-subscriber",
            "examples.cache_alerts:alerts",
            "--nats-url",
            nats_server.url,
            "--nats-credentials",
            str(nats_credentials["services"]),
        ],
        cwd=Path(__file__).parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    try:

        async def feed() -> None:
            assert nats_server.auth is not None
            publisher = await Bus.connect(nats_server.url, "tests", credentials=nats_server.auth.service)
            try:
                await asyncio.sleep(3)  # its consumer in place ("new": only what comes after)
                for _ in range(60):
                    await publisher.publish(event_subject("prefill_completed"), prefill(0, gpu="L40S"))
            finally:
                await publisher.close()

        asyncio.run(feed())
        time.sleep(2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "prefix-cache hit rate dropped" in output and "L40S" in output
