"""Reliability through real processes on a real NATS: mid-stream migration when a worker is
killed or drained, cancellation that frees the GPU, liveness, the migration limit.

The mesh here has one prefill and two decode workers (sim engine at real time, so a stream of a
few hundred tokens lasts seconds) and allows one migration per request.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest
from nats.aio.client import Client as NatsClient

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from ripplemesh.traces import load_request_trace
from schemas.events import (
    InferenceRequest,
    PrefillWork,
    StreamFailed,
    StreamFinished,
    TokenChunk,
    TokenEvent,
    Usage,
    WorkerState,
    derived_event_id,
    encode_event,
    new_event_id,
)
from schemas.subjects import LIFECYCLE, WORKERS, event_subject, tokens_subject, work_subject
from services.ingress.prepare import ClientRequest, prepare
from services.mesh.config import load_config
from services.mesh.embedded_nats import free_port
from services.mesh.token_stream import TokenStream, stored_events
from tests.conftest import TEST_CONFIG, TEST_KEY, wait_until

pytestmark = pytest.mark.timeout(240)

# A long answer: at real time the sim engine streams about a hundred tokens a second.
LONG = 500
PROMPT = "tell me everything about the history of the river and its bridges"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Prefill 1, decode 2, sim at real time, one migration allowed per request; its own NATS."""
    root = tmp_path_factory.mktemp("fleet")
    config = root / "ripplemesh.toml"
    config.write_text("max_migrations = 1\n" + TEST_CONFIG)
    mesh = Mesh(
        data_dir=root / "data",
        config_path=config,
        http_port=free_port(),
        prefill=1,
        decode=2,
        time_scale=1.0,
    ).start()
    yield mesh
    mesh.stop()


@pytest.fixture
async def client(fleet: Mesh) -> AsyncIterator[MeshClient]:
    async with MeshClient(fleet.url, "acme", credentials=fleet.credentials("acme")) as connected:
        yield connected


@pytest.fixture
async def nc(fleet: Mesh) -> AsyncIterator[NatsClient]:
    connection = await nats.connect(fleet.url, **fleet.connect_options())  # type: ignore[arg-type]
    yield connection
    await connection.drain()


def prepared(mesh: Mesh, request_id: str, prompt: str, *, max_tokens: int) -> InferenceRequest:
    """A request as ingress prepares it, for a test that places its work by hand."""
    client = ClientRequest(
        request_id=request_id,
        tenant="acme",
        model="llama-3-8b",
        api="nats",
        prompt=prompt,
        messages=None,
        max_tokens=max_tokens,
    )
    return prepare(client, load_config(mesh.config_path), time.time())


def health(mesh: Mesh, name: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{mesh.child(name).url}/healthz", timeout=2) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def serving(mesh: Mesh, role: str) -> str:
    """The worker of `role` that is running a sequence now."""

    def busy() -> str | None:
        for child in mesh.children:
            if child.name.startswith(role) and child.process and child.process.poll() is None:
                if health(mesh, child.name).get("running", 0) > 0:
                    return child.name
        return None

    found: str = wait_until(busy, timeout_s=10, interval_s=0.02)
    return found


def kill(mesh: Mesh, name: str) -> None:
    process = mesh.child(name).process
    assert process is not None
    process.send_signal(signal.SIGKILL)
    process.wait(10)


def restore(mesh: Mesh, *names: str) -> None:
    for name in names:
        mesh.restart_child(name)
    # Back in every router's view (a heartbeat) before the next test places work.
    wait_until(lambda: health(mesh, "router")["workers"] == 3, timeout_s=15)


async def read_until(events: AsyncIterator[TokenEvent], tokens: int, seen: list[TokenEvent]) -> None:
    count = 0
    while count < tokens:
        event = await anext(events)
        seen.append(event)
        assert isinstance(event, TokenChunk), event
        count += len(event.token_ids)


def check_one_stream(seen: list[TokenEvent], expected: list[int]) -> StreamFinished:
    """Every chunk once, in order, ending with StreamFinished; the tokens of an uninterrupted run."""
    assert [e.seq for e in seen] == list(range(len(seen)))
    final = seen[-1]
    assert isinstance(final, StreamFinished), final
    tokens = [t for e in seen if isinstance(e, TokenChunk) for t in e.token_ids]
    assert tokens == expected
    assert final.usage.completion_tokens == len(expected)
    return final


async def dropped_from_workers(watch: Any) -> tuple[float, float]:
    """When a worker's WORKERS entry is deleted, and its last heartbeat's time before that."""
    last_heartbeat = 0.0
    while True:
        entry = await watch.updates(timeout=30)
        if entry is None:
            continue
        if entry.operation in ("DEL", "PURGE"):
            return time.time(), last_heartbeat
        if entry.value:
            last_heartbeat = msgspec.json.decode(entry.value, type=WorkerState).occurred_at


async def lifecycle_events(nc: NatsClient, kind: str, request_id: str) -> list[Any]:
    """The request's stored lifecycle events of one kind."""
    found = []
    js = nc.jetstream(timeout=5)
    sub = await js.subscribe(event_subject(kind), stream=LIFECYCLE.name, ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                return found
            event = msgspec.json.decode(msg.data)
            if event.get("request_id") == request_id:
                found.append(event)
    finally:
        await sub.unsubscribe()


async def wait_for_events(nc: NatsClient, kind: str, request_id: str, count: int = 1) -> list[Any]:
    deadline = time.monotonic() + 15
    while True:
        found = await lifecycle_events(nc, kind, request_id)
        if len(found) >= count or time.monotonic() > deadline:
            return found


# ---------------------------------------------------------------- migration


async def test_killed_decode_worker_the_nats_client_gets_one_whole_stream(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    expected = (await client.complete(prompt=PROMPT, max_tokens=LONG)).token_ids
    workers = await nc.jetstream().key_value(WORKERS.bucket)
    events = client.events(prompt=PROMPT, max_tokens=LONG, request_id="killed-decode")
    seen: list[TokenEvent] = []
    await read_until(events, 40, seen)
    victim = await asyncio.to_thread(serving, fleet, "decode")
    watch = await workers.watch(victim)
    dropped = asyncio.ensure_future(dropped_from_workers(watch))
    try:
        await asyncio.to_thread(kill, fleet, victim)
        async for event in events:
            seen.append(event)
        check_one_stream(seen, expected)
        # Liveness: the worker is dropped from WORKERS (what routers and admission watch)
        # within 3 s of its last heartbeat.
        deleted_at, last_heartbeat = await asyncio.wait_for(dropped, timeout=10)
        assert deleted_at - last_heartbeat <= 3.0 + 0.25  # scheduling slack
        migrated = await wait_for_events(nc, "migrated", "killed-decode")
        assert [(m["from_worker"], m["reason"], m["migration"]) for m in migrated] == [
            (victim, "worker_lost", 1)
        ]
        assert migrated[0]["resume_seq"] >= 1 and migrated[0]["delivered_tokens"] >= 40
        router = health(fleet, "router")
        assert victim in router["migration"]["gone"]
        assert victim not in router["kv_index"]["by_worker"]  # its cached blocks dropped

        # The migration's span roots its own trace, linked to the original placement's span.
        def migration_span() -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
            spans = load_request_trace(fleet.data_dir, "killed-decode")
            by_id = {span["span_id"]: span for span in spans}
            found = [span for span in spans if span["name"] == "router.migrate" and span.get("links")]
            return (found[0], by_id) if found and found[0]["links"][0]["span_id"] in by_id else None

        span, by_id = await asyncio.to_thread(wait_until, migration_span, 15)
        original = by_id[span["links"][0]["span_id"]]
        assert original["trace_id"] != span["trace_id"] and original["kind"] == "PRODUCER"
        assert span["attributes"]["ripple.migration.from_worker"] == victim
    finally:
        dropped.cancel()
        await watch.stop()
        await asyncio.to_thread(restore, fleet, victim)


async def test_two_router_replicas_place_a_migrated_request_once(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    router = fleet.child("router")
    args = list(router.args)
    port = free_port()
    args[args.index("--http-port") + 1] = str(port)
    second = await asyncio.to_thread(start_process, args, fleet.data_dir / "logs" / "router-2.log")
    victim = None
    try:
        replica = f"http://127.0.0.1:{port}/healthz"
        await asyncio.to_thread(wait_until, lambda: _healthy_with_workers(replica, 3), 30)
        expected = (await client.complete(prompt=PROMPT + " two routers", max_tokens=LONG)).token_ids
        events = client.events(prompt=PROMPT + " two routers", max_tokens=LONG, request_id="two-routers")
        seen: list[TokenEvent] = []
        await read_until(events, 40, seen)
        victim = await asyncio.to_thread(serving, fleet, "decode")
        await asyncio.to_thread(kill, fleet, victim)
        async for event in events:
            seen.append(event)
        check_one_stream(seen, expected)
        # Both replicas took the lost worker's work over; JetStream kept one re-placement.
        for url in (f"{router.url}/healthz", replica):
            with urllib.request.urlopen(url, timeout=2) as response:
                assert victim in json.loads(response.read())["migration"]["gone"]
        assert len(await wait_for_events(nc, "migrated", "two-routers")) == 1
        placed = [
            d for d in await lifecycle_events(nc, "route_decision", "two-routers") if d["outcome"] == "placed"
        ]
        assert len(placed) == 2  # the first placement and the migration's
    finally:
        second.send_signal(signal.SIGTERM)
        await asyncio.to_thread(second.wait, 20)
        if victim is not None:
            await asyncio.to_thread(restore, fleet, victim)


def ripplemesh(mesh: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    """The `ripplemesh` command, as the services' user."""
    credentials = ["--nats-url", mesh.url, "--nats-credentials", str(mesh.credential_files["services"])]
    return subprocess.run(
        [sys.executable, "-m", "ripplemesh", *args, *credentials], capture_output=True, text=True, timeout=60
    )


async def test_draining_an_unknown_worker_is_a_clear_error(fleet: Mesh) -> None:
    result = await asyncio.to_thread(ripplemesh, fleet, "drain", "no-such-worker")
    assert result.returncode == 1
    assert "no worker 'no-such-worker' answers on rmesh.control.no-such-worker" in result.stderr


def start_process(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _healthy_with_workers(url: str, workers: int) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(json.loads(response.read())["workers"] >= workers)
    except Exception:
        return False


async def test_killed_decode_worker_the_http_client_gets_one_whole_stream(
    fleet: Mesh, client: MeshClient
) -> None:
    expected = await client.complete(prompt=PROMPT + " over http", max_tokens=LONG)
    body = {
        "model": "llama-3-8b",
        "prompt": PROMPT + " over http",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts: list[str] = []
    usage = None
    victim = None
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream(
            "POST",
            f"http://127.0.0.1:{fleet.http_port}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {TEST_KEY}"},
        ) as response,
    ):
        assert response.status_code == 200
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    texts.append(choice["text"])
                if victim is None and len(texts) >= 40:
                    victim = await asyncio.to_thread(serving, fleet, "decode")
                    await asyncio.to_thread(kill, fleet, victim)
        finally:
            if victim is not None:
                await asyncio.to_thread(restore, fleet, victim)
    assert victim is not None
    assert "".join(texts) == expected.text
    assert usage is not None and usage["completion_tokens"] == LONG


async def test_killed_prefill_worker_its_request_is_placed_again(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    prompt = " ".join(["the"] * 1500)  # 1500 tokens
    prefill = fleet.child("prefill-0")
    normal = list(prefill.args)
    # A slow prefill worker (40x slower than the GPU it models), so a prefill lasts seconds.
    prefill.args[prefill.args.index("--time-scale") + 1] = "40"
    await asyncio.to_thread(fleet.restart_child, "prefill-0")
    await asyncio.to_thread(wait_until, lambda: health(fleet, "router")["workers"] == 3, 15)
    try:
        # The router's policy may serve a request aggregated on a decode worker; this one is
        # placed on the prefill worker as the router places disaggregated work.
        request = prepared(fleet, "killed-prefill", prompt, max_tokens=30)
        work = PrefillWork(
            event_id=new_event_id(),
            occurred_at=time.time(),
            request=request,
            prefill_worker="prefill-0",
            decode_worker="decode-0",
        )
        stream = TokenStream(
            nc, tokens_subject("acme", "killed-prefill"), first_event_timeout_s=30, idle_timeout_s=30
        )
        async with stream:
            await nc.jetstream().publish(
                work_subject("prefill", "prefill-0"),
                encode_event(work),
                headers={"Nats-Msg-Id": work.event_id},
            )
            assert await asyncio.to_thread(serving, fleet, "prefill") == "prefill-0"
            await asyncio.to_thread(kill, fleet, "prefill-0")
            seen = [event async for event in stream.events()]
        reference = (await client.complete(prompt=prompt, max_tokens=30)).token_ids
        check_one_stream(seen, reference)
        migrated = await wait_for_events(nc, "migrated", "killed-prefill")
        assert [(m["from_worker"], m["from_phase"], m["resume_seq"]) for m in migrated] == [
            ("prefill-0", "prefill", 0)
        ]
    finally:
        prefill.args[:] = normal
        await asyncio.to_thread(restore, fleet, "prefill-0")


async def test_work_sent_before_a_workers_restart_but_stored_after_it_is_served_once(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    """A router's publish retried through a stream's election is stored after the worker it was
    sent to restarted and had looked for its predecessor's work. Sent before that start, it is
    the predecessor's: the routers take it over, and the new incarnation leaves it to them
    rather than serve it too (before, it served it, a rescan migrated it mid-stream, and a
    resumed copy placed back on it met the original: "already on this engine")."""
    await asyncio.to_thread(fleet.restart_child, "decode-0")
    await asyncio.to_thread(wait_until, lambda: health(fleet, "router")["workers"] == 3, 15)
    js = nc.jetstream()
    entry = await (await js.key_value(WORKERS.bucket)).get("decode-0")
    started_at = msgspec.json.decode(entry.value or b"", type=WorkerState).started_at
    assert started_at is not None and time.time() - started_at < 10  # the routers still scan
    rid, prompt = "stored-after-restart", PROMPT + " stored late"
    work = PrefillWork(
        event_id=new_event_id(),
        occurred_at=started_at - 0.5,
        request=prepared(fleet, rid, prompt, max_tokens=LONG),
        prefill_worker="decode-0",
        decode_worker="decode-0",
    )
    stream = TokenStream(nc, tokens_subject("acme", rid), first_event_timeout_s=30, idle_timeout_s=30)
    async with stream:
        await js.publish(
            work_subject("prefill", "decode-0"), encode_event(work), headers={"Nats-Msg-Id": work.event_id}
        )
        seen = [event async for event in stream.events()]
    check_one_stream(seen, (await client.complete(prompt=prompt, max_tokens=LONG)).token_ids)
    migrated = await wait_for_events(nc, "migrated", rid)
    # Taken over before a token was streamed: the restarted worker never served it itself.
    assert [(m["from_worker"], m["resume_seq"]) for m in migrated] == [("decode-0", 0)]


async def test_a_worker_lost_between_its_streams_end_and_its_report_is_reported_for_once(
    fleet: Mesh, nc: NatsClient
) -> None:
    """The client's stream ended but the worker died before it told the ledger: the take-over
    publishes the completion the worker would have (its event id, the stream's usage, no GPU
    time), so the ledger counts the request completed, once."""
    rid = "ended-unreported"
    request = prepared(fleet, rid, PROMPT, max_tokens=2)
    # Aggregated on a worker that is gone: its work still on its subject, its stream complete.
    work = PrefillWork(
        event_id=new_event_id(),
        occurred_at=time.time(),
        request=request,
        prefill_worker="ghost-0",
        decode_worker="ghost-0",
    )
    js = nc.jetstream()
    usage = Usage(prompt_tokens=len(request.prompt_tokens), completion_tokens=2)
    for event in (
        TokenChunk(
            event_id=f"{rid}-0", occurred_at=time.time(), request_id=rid, seq=0, token_ids=[300], text="a"
        ),
        TokenChunk(
            event_id=f"{rid}-1", occurred_at=time.time(), request_id=rid, seq=1, token_ids=[301], text="b"
        ),
        StreamFinished(
            event_id=f"{rid}-2",
            occurred_at=time.time(),
            request_id=rid,
            seq=2,
            finish_reason="length",
            usage=usage,
        ),
    ):
        await js.publish(
            tokens_subject("acme", rid), encode_event(event), headers={"Nats-Msg-Id": event.event_id}
        )
    await js.publish(
        work_subject("prefill", "ghost-0"), encode_event(work), headers={"Nats-Msg-Id": work.event_id}
    )
    await (await js.key_value(WORKERS.bucket)).delete("ghost-0")  # gone, as a lost worker's entry
    (completed,) = await wait_for_events(nc, "decode_completed", rid)
    assert completed["event_id"] == derived_event_id(work.event_id, "decode_completed")
    assert completed["usage"]["completion_tokens"] == 2 and completed["gpu_seconds"] == 0.0
    ledger = fleet.child("ledger").url

    def recorded() -> dict[str, Any] | None:
        response = httpx.get(f"{ledger}/v1/ledger/requests/{rid}", timeout=5)
        return response.json() if response.status_code == 200 else None

    row = await asyncio.to_thread(wait_until, recorded, 15)
    assert row["status"] == "completed"


async def test_drained_decode_worker_hands_its_stream_off_and_exits(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    expected = (await client.complete(prompt=PROMPT + " drained", max_tokens=LONG)).token_ids
    events = client.events(prompt=PROMPT + " drained", max_tokens=LONG, request_id="drained")
    seen: list[TokenEvent] = []
    await read_until(events, 40, seen)
    victim = await asyncio.to_thread(serving, fleet, "decode")
    try:
        # An operator drains it; it says it is draining at once (in WORKERS: routers stop placing
        # work there).
        drained = await asyncio.to_thread(ripplemesh, fleet, "drain", victim, "--grace", "0.5")
        assert drained.returncode == 0 and f"{victim} is draining" in drained.stderr, drained
        state = await (await nc.jetstream().key_value(WORKERS.bucket)).get(victim)
        assert msgspec.json.decode(state.value or b"", type=WorkerState).draining
        others = await asyncio.gather(
            *(
                client.complete(
                    prompt=f"placed while draining {i}", max_tokens=3, request_id=f"after-drain-{i}"
                )
                for i in range(4)
            )
        )
        assert [o.usage.completion_tokens for o in others] == [3] * 4
        for i in range(4):
            completed = await wait_for_events(nc, "decode_completed", f"after-drain-{i}")
            assert completed and completed[0]["worker_id"] != victim
        # The stream in flight outlives the grace period: handed off, one whole stream.
        async for event in events:
            seen.append(event)
        check_one_stream(seen, expected)
        migrated = await wait_for_events(nc, "migrated", "drained")
        assert [(m["from_worker"], m["reason"]) for m in migrated] == [(victim, "worker_drained")]
        stopped = await wait_for_events(nc, "work_stopped", "drained")
        assert stopped and stopped[0]["reason"] == "drained" and stopped[0]["gpu_seconds"] > 0
        process = fleet.child(victim).process
        assert process is not None
        assert await asyncio.to_thread(process.wait, 20) == 0  # it exited, cleanly
    finally:
        await asyncio.to_thread(restore, fleet, victim)


async def test_past_the_migration_limit_the_stream_fails_clearly(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    events = client.events(prompt=PROMPT + " twice", max_tokens=LONG, request_id="limit")
    seen: list[TokenEvent] = []
    killed = []
    try:
        await read_until(events, 40, seen)
        killed.append(await asyncio.to_thread(serving, fleet, "decode"))
        await asyncio.to_thread(kill, fleet, killed[0])
        await read_until(events, 20, seen)  # migrated once (the limit): streaming again
        killed.append(await asyncio.to_thread(serving, fleet, "decode"))
        assert killed[1] != killed[0]
        await asyncio.to_thread(kill, fleet, killed[1])
        async for event in events:
            seen.append(event)
        failure = seen[-1]
        assert isinstance(failure, StreamFailed), failure
        assert failure.code == "internal" and failure.http_status == 503
        assert "the limit is 1 migration(s) per request" in failure.message
        assert [e.seq for e in seen] == list(range(len(seen)))
        failed = await wait_for_events(nc, "failed", "limit")
        assert failed and failed[0]["stage"] == "router"
    finally:
        await asyncio.to_thread(restore, fleet, *killed)


# ---------------------------------------------------------------- cancellation


def engine_idle(mesh: Mesh, worker: str) -> bool:
    state = health(mesh, worker)
    return state["running"] == 0 and state["kv_blocks_used"] == 0 and state["in_flight"] == 0


async def test_an_http_client_that_disconnects_frees_the_gpu_within_a_second(
    fleet: Mesh, nc: NatsClient
) -> None:
    body = {"model": "llama-3-8b", "prompt": PROMPT + " then hang up", "max_tokens": 2000, "stream": True}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream(
            "POST",
            f"http://127.0.0.1:{fleet.http_port}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {TEST_KEY}"},
        ) as response,
    ):
        request_id = response.headers["x-ripple-request-id"]
        lines = response.aiter_lines()
        for _ in range(20):
            await anext(lines)
        worker = await asyncio.to_thread(serving, fleet, "decode")
    hung_up = time.time()
    await asyncio.to_thread(wait_until, lambda: engine_idle(fleet, worker), 1.0, 0.02)
    freed_in = time.time() - hung_up
    # Nothing generated for nobody: no token published a second after the hang-up.
    stored = await stored_events(nc, tokens_subject("acme", request_id))
    chunks = [e for e in stored if isinstance(e, TokenChunk)]
    assert chunks and max(c.occurred_at for c in chunks) < hung_up + 1.0
    assert not any(isinstance(e, StreamFinished) for e in stored)
    cancelled = await wait_for_events(nc, "cancelled", request_id)
    assert [c["reason"] for c in cancelled] == ["client_disconnected"]
    stopped = await wait_for_events(nc, "work_stopped", request_id)
    assert [s["reason"] for s in stopped] == ["cancelled"] and stopped[0]["gpu_seconds"] > 0
    # The ledger prices what was spent, on a request that did not succeed.
    ledger = fleet.child("ledger").url

    def row() -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{ledger}/v1/ledger/requests/{request_id}", timeout=2) as r:
                found: dict[str, Any] = json.loads(r.read())
        except Exception:
            return None
        return found if found.get("status") == "failed" and found["decode_gpu_seconds"] > 0 else None

    assert await asyncio.to_thread(wait_until, row, 15)
    print(f"GPU freed {freed_in:.3f} s after the HTTP client hung up")


async def test_a_nats_client_that_cancels_frees_the_gpu_and_no_tenant_cancels_anothers(
    fleet: Mesh, client: MeshClient, nc: NatsClient
) -> None:
    # Another tenant cannot cancel acme's request: it goes on to the end.
    async with MeshClient(fleet.url, "tiny", credentials=fleet.credentials("tiny")) as intruder:
        events = client.events(prompt=PROMPT + " not yours", max_tokens=150, request_id="not-yours")
        seen: list[TokenEvent] = []
        await read_until(events, 10, seen)
        await intruder.cancel("not-yours")
        async for event in events:
            seen.append(event)
        assert isinstance(seen[-1], StreamFinished) and seen[-1].usage.completion_tokens == 150
    # The owner cancels by closing its stream early.
    events = client.events(prompt=PROMPT + " cancel me", max_tokens=2000, request_id="cancel-me")
    seen = []
    await read_until(events, 20, seen)
    worker = await asyncio.to_thread(serving, fleet, "decode")
    await events.aclose()  # type: ignore[attr-defined]
    await asyncio.to_thread(wait_until, lambda: engine_idle(fleet, worker), 1.0, 0.02)
    cancelled = await wait_for_events(nc, "cancelled", "cancel-me")
    assert [c["reason"] for c in cancelled] == ["client_cancelled"]


async def test_worker_health_shows_its_engine_now(fleet: Mesh) -> None:
    for name in ("prefill-0", "decode-0", "decode-1"):
        state = health(fleet, name)
        assert {"running", "queue_depth", "kv_blocks_used", "in_flight", "draining"} <= set(state)
