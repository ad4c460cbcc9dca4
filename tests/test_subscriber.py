"""The subscriber SDK (ripplemesh/subscriber.py) on the real NATS: typed events in, at-least-once,
dead letters with the reason, durable positions, `ripplemesh run-subscriber`."""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from ripplemesh import Context, PermanentError, Subscriber
from schemas.events import DeadLetter, InferenceRequest, PrefillCompleted, RequestFailed, new_event_id
from schemas.subjects import DLQ, LIFECYCLE, TENANT_THROTTLES, dlq_subject, event_subject
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


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


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
        from prometheus_client import REGISTRY

        labels = {"subscriber": sub.name, "handler": "prefilled", "outcome": "ok"}
        assert REGISTRY.get_sample_value("ripplemesh_subscriber_events_total", labels) == len(events)
    finally:
        await sub.stop()


async def test_a_handler_by_subject_gets_every_event_on_its_subjects_and_no_others(bus: Bus) -> None:
    by_subject: list[str] = []
    by_type: list[str] = []
    sub = Subscriber(name())

    @sub.on_subject(event_subject("prefill_completed"))
    async def prefills(event: PrefillCompleted, context: Context) -> None:
        by_subject.append(context.event_id)

    @sub.on(RequestFailed)
    async def failures(event: RequestFailed, context: Context) -> None:
        by_type.append(context.event_id)

    await sub.start(bus)
    try:
        wanted, failure = prefill(10), failed()
        await bus.publish(event_subject("failed"), failure)
        await bus.publish(event_subject("prefill_completed"), wanted)
        await until(lambda: by_subject == [wanted.event_id] and by_type == [failure.event_id])
    finally:
        await sub.stop()


def test_a_subscriber_refuses_what_the_event_stream_does_not_carry() -> None:
    sub = Subscriber(name())
    with pytest.raises(TypeError, match="InferenceRequest: not on the event stream"):
        sub.on(InferenceRequest)
    with pytest.raises(ValueError, match=r"under rmesh\.events\."):
        sub.on_subject("rmesh.tokens.>")
    with pytest.raises(ValueError, match="not a NATS subject pattern"):
        sub.on_subject("rmesh.events.prefill_*")  # a wildcard is a whole token


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
    nats_server: EmbeddedNats, nats_credentials: dict[str, Path], tmp_path: Path
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
            str(nats_credentials["subscribers"]),
            "--data-dir",
            str(tmp_path),
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
                # One from a trace of its own: the handler's span continues it.
                traced = prefill(0, gpu="L40S")
                headers = {"Nats-Msg-Id": traced.event_id, "traceparent": f"00-{TRACE_ID}-{'1' * 16}-01"}
                await publisher.js.publish(
                    event_subject("prefill_completed"), msgspec.json.encode(traced), headers=headers
                )
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
    spans = [
        json.loads(line) for f in (tmp_path / "traces").glob("*.jsonl") for line in f.read_text().splitlines()
    ]
    continued = [span for span in spans if span["trace_id"] == TRACE_ID]
    assert continued and continued[0]["parent_id"] == "1" * 16
    assert continued[0]["service"] == "ripplemesh-subscriber"


def test_a_throttle_holds_while_in_force_and_says_why() -> None:
    from schemas.events import TenantThrottle
    from services.admission.policy import throttled

    throttle = TenantThrottle(
        event_id="t1",
        occurred_at=0.0,
        tenant="acme",
        until=1000.0,
        reason="daily budget $5 spent",
        source="guard",
    )
    rejected = throttled({"acme": throttle}, "acme", 400.0)
    assert rejected is not None and rejected.reason == "quota" and rejected.retry_after_s == 600.0
    assert "by guard: daily budget $5 spent" in rejected.message
    assert throttled({"acme": throttle}, "acme", 1000.0) is None  # lapsed
    assert throttled({"acme": throttle}, "tiny", 400.0) is None


def test_the_budget_guard_prices_as_the_ledger_and_throttles_once_a_day() -> None:
    from examples.budget_guard import BudgetGuard, next_midnight_utc

    guard = BudgetGuard({"acme": 1.0}, {"H100": 3.6})
    day = 1_800_000_000.0  # a fixed moment
    assert not guard.charge("acme", "H100", 900.0, day)  # $0.90
    assert guard.charge("acme", "H100", 200.0, day + 1)  # $1.10: over, throttle
    assert not guard.charge("acme", "H100", 200.0, day + 2)  # already throttled today
    assert not guard.charge("other", "H100", 1e6, day)  # no budget set
    assert not guard.charge("acme", "H999", 1.0, day)  # not priced: logged, not counted
    assert 0 < next_midnight_utc(day) - day <= 86400


async def test_a_budget_guard_closes_the_loop_admission_refuses_the_tenant_until_lifted(mesh) -> None:  # type: ignore[no-untyped-def]
    """Through the whole mesh: a request is served, the guard sees its cost pass the tenant's
    budget and throttles it; the next request gets a 429 saying why; lifted, it is served."""
    import openai

    from examples import budget_guard
    from tests.conftest import TEST_KEY

    guard = Subscriber(name(), start_from="new")
    guard.handlers = budget_guard.guard.handlers
    policy = budget_guard.policy
    policy.daily_usd = {"acme": 0.0}  # any spend is over
    policy.throttled.clear()
    assert mesh.auth is not None
    bus = await Bus.connect(mesh.url, "tests", credentials=mesh.auth.service)
    api = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key=TEST_KEY, max_retries=0
    )
    await guard.start(bus)
    try:
        first = await api.chat.completions.create(
            model="llama-3-8b", messages=[{"role": "user", "content": "spend something"}], max_tokens=8
        )
        assert first.choices[0].message.content
        deadline = time.monotonic() + 15
        while True:
            try:
                await api.chat.completions.create(
                    model="llama-3-8b", messages=[{"role": "user", "content": "again"}], max_tokens=4
                )
            except openai.RateLimitError as exc:
                assert "throttled" in str(exc) and "daily budget $0 spent" in str(exc)
                assert exc.response.headers.get("retry-after")
                break
            assert time.monotonic() < deadline, "the tenant was never throttled"
            await asyncio.sleep(0.3)
    finally:
        kv = await bus.key_value(TENANT_THROTTLES)
        with contextlib.suppress(Exception):
            await kv.delete("acme")
        await guard.stop()
        policy.daily_usd = {}
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                await api.chat.completions.create(
                    model="llama-3-8b", messages=[{"role": "user", "content": "lifted"}], max_tokens=4
                )
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the throttle was never lifted"
                await asyncio.sleep(0.3)
    finally:
        await api.close()
        await bus.close()


async def test_a_subscriber_has_a_user_of_its_own_that_reads_events_and_no_tenant_s_tokens_unless_granted(
    bus: Bus, nats_server: EmbeddedNats
) -> None:
    import nats

    from schemas.events import TokenChunk
    from schemas.subjects import tokens_subject

    assert nats_server.auth is not None and nats_server.auth.subscribers is not None
    own = await Bus.connect(nats_server.url, "subscriber", credentials=nats_server.auth.subscribers)
    got: list[str] = []
    sub = Subscriber(name(), max_deliver=2, retry_backoff_s=(0.05,))

    @sub.on(RequestFailed)
    async def on_failed(event: RequestFailed, context: Context) -> None:
        got.append(event.message)
        if event.message == "throttle":
            await context.throttle_tenant("tiny", until=time.time() + 1, reason="a test")
            await context.lift_throttle("tiny")
        if event.message == "raise":
            raise PermanentError("no")

    await sub.start(own)
    spy: nats.NATS | None = None
    try:
        for message in ("hello", "throttle", "raise"):
            await bus.publish(event_subject("failed"), failed(message))
        await until(lambda: got == ["hello", "throttle", "raise"])
        assert len(await dead_letters(bus, sub.spec().durable, 1)) == 1  # its dead letter went out
        # No tenant's tokens: the server refuses the subscription.
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        spy = await nats.connect(
            servers=nats_server.url, error_cb=on_error, **nats_server.auth.subscribers.connect_options()
        )
        seen: list[bytes] = []

        async def on_token(msg) -> None:  # type: ignore[no-untyped-def]
            seen.append(msg.data)

        await spy.subscribe("rmesh.tokens.>", cb=on_token)
        await spy.flush()
        chunk = TokenChunk(
            event_id=new_event_id(), occurred_at=time.time(), request_id="r1", seq=0, token_ids=[1], text="x"
        )
        await bus.nc.publish(tokens_subject("acme", "r1"), msgspec.json.encode(chunk))
        await asyncio.sleep(0.5)
        assert seen == []
        assert any("permissions violation" in str(e).lower() for e in errors), errors
        # A tenant whose config grants it (`subscribers_read_tokens`, tenant "plain" in the
        # test config): its token streams, and still no other tenant's.
        errors.clear()
        await spy.subscribe("rmesh.tokens.plain.>", cb=on_token)
        await spy.subscribe("rmesh.tokens.acme.>", cb=on_token)
        await spy.flush()
        for tenant in ("acme", "plain"):
            await bus.nc.publish(tokens_subject(tenant, f"r-{tenant}"), msgspec.json.encode(chunk))
        await bus.nc.flush(timeout=5)
        # (Once in about 20 runs here the granted tenant's chunk did not arrive in 10 s; what
        # the spy saw and was told is printed to find out why.)
        try:
            await until(lambda: len(seen) == 1)
        except AssertionError:
            raise AssertionError(
                f"seen {seen}, errors {errors}, spy connected {spy.is_connected}, spy subscriptions "
                f"{[sub.subject for sub in spy._subs.values()]}, publisher connected {bus.nc.is_connected}"
            ) from None
        await asyncio.sleep(0.3)
        assert len(seen) == 1 and any("rmesh.tokens.acme" in str(e) for e in errors), errors
    finally:
        if spy is not None:
            await spy.close()
        await sub.stop()
        await own.close()
