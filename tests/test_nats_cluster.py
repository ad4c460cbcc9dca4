"""The mesh on a 3-node NATS cluster (R3 streams) loses a node, then its ledger, under load.

Real processes and real NATS: a steady stream of requests from one tenant client; the NATS
node that is both the client's server and the leader of the REQUESTS stream is killed with
SIGKILL, then the ledger is, and restarted. Every request must complete or end with a clear
error, none may hang, and the ledger must count exactly what the client received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from ripplemesh.client import MeshClient, MeshUnavailable
from ripplemesh.launcher import Mesh
from schemas.events import ReplayTokens, StreamFailed, StreamFinished, TokenChunk, encode_event, new_event_id
from schemas.subjects import KV_BUCKETS, STREAMS, request_subject
from services.mesh.bus import publish_acked, reconnecting_options
from services.mesh.embedded_nats import EmbeddedNats, free_port
from services.mesh.token_stream import StreamTimeout

pytestmark = pytest.mark.timeout(240)

REQUESTS = 200
RATE_PER_S = 10.0
MAX_TOKENS = 32
KILL_NODE_AT = 50  # requests submitted when the NATS node is killed (about 5 s in)
KILL_LEDGER_AT = 130  # ... and when the ledger is (about 13 s in)


@dataclass
class Outcome:
    request_id: str
    status: str  # completed | failed | timeout
    tokens: int = 0  # tokens the client received
    usage_tokens: int = 0
    message: str = ""


@dataclass
class Clock:
    start: float = field(default_factory=time.monotonic)
    node_killed: float | None = None
    reconnected: float | None = None
    probes: list[tuple[float, float]] = field(default_factory=list)  # (sent, acked)
    leaders_back: float | None = None

    def since_kill(self, t: float | None) -> float | None:
        return None if t is None or self.node_killed is None else round(t - self.node_killed, 2)


def _ledger(mesh: Mesh, path: str) -> dict:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(f"{mesh.child('ledger').url}{path}", timeout=5) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise


# Every replicated stream of the mesh: its own, and those behind the KV buckets.
MESH_STREAMS = [spec.name for spec in STREAMS] + [f"KV_{bucket.bucket}" for bucket in KV_BUCKETS]


async def _stream_leaders(js: nats.js.JetStreamContext) -> dict[str, str | None]:
    leaders: dict[str, str | None] = {}
    for name in MESH_STREAMS:
        try:
            info = await js.stream_info(name)
            leaders[name] = info.cluster.leader if info.cluster else None
        except Exception:
            leaders[name] = None
    return leaders


async def _lead_everything(nc: nats.NATS, js: nats.js.JetStreamContext, server: str) -> None:
    """Move every stream's leadership to one server: losing it then elects them all again."""
    for _ in range(50):
        leaders = await _stream_leaders(js)
        elsewhere = [name for name, leader in leaders.items() if leader != server]
        if not elsewhere:
            return
        for name in elsewhere:
            with contextlib.suppress(Exception):
                await nc.request(
                    f"$JS.API.STREAM.LEADER.STEPDOWN.{name}",
                    json.dumps({"placement": {"preferred": server}}).encode(),
                    timeout=5,
                )
        await asyncio.sleep(0.5)
    raise AssertionError(f"could not move every stream's leader to {server}: {leaders}")


async def test_a_node_and_the_ledger_lost_under_load_lose_no_request(
    nats_cluster: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    assert nats_cluster.auth is not None
    mesh = Mesh(
        data_dir=tmp_path / "mesh",
        config_path=test_config,
        nats_url=nats_cluster.url,
        auth=nats_cluster.auth,
        nats_replicas=3,
        http_port=free_port(),
        prefill=1,
        decode=1,
        time_scale=1.0,
    )
    await asyncio.to_thread(mesh.start, 90.0)
    clock = Clock()
    tenant = mesh.credentials("acme")
    admin: nats.NATS | None = None
    nc: nats.NATS | None = None
    background: list[asyncio.Task[None]] = []
    try:
        admin = await nats.connect(
            nats_cluster.urls, **reconnecting_options("test-admin"), **mesh.connect_options()
        )
        js = admin.jetstream(timeout=2)
        # The worst node to lose: the client's server, and the leader of every stream (requests,
        # work, tokens, lifecycle, the workers' heartbeats): the client reconnects, and every
        # stream elects a new leader, at once.
        victim = nats_cluster.nodes[0]
        await _lead_everything(admin, js, victim.name)
        servers = [victim.url] + [n.url for n in nats_cluster.nodes if n is not victim]

        async def on_reconnect() -> None:
            if clock.node_killed is not None and clock.reconnected is None:
                clock.reconnected = time.monotonic()

        nc = await nats.connect(
            servers,
            dont_randomize=True,
            reconnected_cb=on_reconnect,
            **reconnecting_options("test-client"),
            **tenant.connect_options(),
        )
        client = MeshClient(
            nats_cluster.url, "acme", nc=nc, credentials=tenant, first_token_timeout_s=30, idle_timeout_s=30
        )

        async def one(i: int) -> Outcome:
            outcome = Outcome(request_id=f"node-loss-{i}", status="timeout")
            try:
                async for event in client.events(
                    prompt=f"request {i} while a node dies",
                    max_tokens=MAX_TOKENS,
                    request_id=outcome.request_id,
                ):
                    if isinstance(event, TokenChunk):
                        outcome.tokens += len(event.token_ids)
                    elif isinstance(event, StreamFinished):
                        outcome.status, outcome.usage_tokens = "completed", event.usage.completion_tokens
                    elif isinstance(event, StreamFailed):
                        outcome.status, outcome.message = "failed", f"{event.code}: {event.message}"
            except (StreamTimeout, MeshUnavailable) as exc:
                outcome.message = str(exc)
            return outcome

        async def probe() -> None:
            """Acked publishes on the submission subject, back to back, until the load ends."""
            while True:
                replay = ReplayTokens(event_id=new_event_id(), occurred_at=time.time(), request_id="probe")
                sent = time.monotonic()
                await publish_acked(
                    nc.jetstream(),
                    request_subject("acme"),
                    encode_event(replay),
                    {"Nats-Msg-Id": replay.event_id},
                    retry_s=60,
                )
                clock.probes.append((sent, time.monotonic()))
                await asyncio.sleep(0.25)

        async def watch_leaders() -> None:
            while clock.leaders_back is None:
                await asyncio.sleep(0.2)
                if clock.node_killed is None:
                    continue
                current = await _stream_leaders(js)
                if all(leader not in (None, victim.name) for leader in current.values()):
                    clock.leaders_back = time.monotonic()

        probing = asyncio.create_task(probe())
        watching = asyncio.create_task(watch_leaders())
        background += [probing, watching]
        tasks: list[asyncio.Task[Outcome]] = []
        ledger_restart: asyncio.Task[None] | None = None
        for i in range(REQUESTS):
            tasks.append(asyncio.create_task(one(i)))
            if i == KILL_NODE_AT:
                clock.node_killed = time.monotonic()
                await asyncio.to_thread(nats_cluster.stop_node, victim, sig=signal.SIGKILL)
            if i == KILL_LEDGER_AT:
                await asyncio.to_thread(mesh.stop_child, "ledger", sig=signal.SIGKILL)
                ledger_restart = asyncio.create_task(asyncio.to_thread(mesh.restart_child, "ledger", 60.0))
            await asyncio.sleep(1 / RATE_PER_S)
        # Bounded: every request ends (tokens, an error or a timeout) within its client timeouts.
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        assert ledger_restart is not None
        await asyncio.wait_for(ledger_restart, timeout=60)
        await asyncio.wait_for(watching, timeout=30)
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
        await _check(mesh, nats_cluster, victim.name, clock, outcomes)
    finally:
        # Nothing of this test may outlive it: the suite shares one event loop, and a client
        # left reconnecting to the stopped cluster would keep running beside later tests.
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for connection in (nc, admin):
            if connection is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(connection.close(), timeout=10)
        await asyncio.to_thread(mesh.stop)


async def _check(
    mesh: Mesh, cluster: EmbeddedNats, victim: str, clock: Clock, outcomes: list[Outcome]
) -> None:
    completed = [o for o in outcomes if o.status == "completed"]
    errors = [o for o in outcomes if o.status != "completed"]
    # The first publish attempted after the kill (the probe loop sends one every 0.25 s and
    # retries it until acked): how long publishing took to work again.
    after_kill = [acked for sent, acked in clock.probes if sent >= (clock.node_killed or 0)]
    worst_probe = max(acked - sent for sent, acked in clock.probes)
    figures = {
        "requests": REQUESTS,
        "completed": len(completed),
        "errors": {o.request_id: (o.status, o.message) for o in errors},
        "lost": REQUESTS - len(completed) - len(errors),
        "client_reconnected_after_s": clock.since_kill(clock.reconnected),
        "publishing_recovered_after_s": clock.since_kill(min(after_kill) if after_kill else None),
        "slowest_acked_publish_s": round(worst_probe, 2),
        "every_stream_led_again_after_s": clock.since_kill(clock.leaders_back),
        "victim": victim,
    }
    print("\nnode-loss figures:", json.dumps(figures))

    # Every request completed or failed clearly; none hung, and none is missing.
    assert figures["lost"] == 0
    assert all(o.message for o in errors), errors
    for outcome in completed:
        assert outcome.tokens == outcome.usage_tokens == MAX_TOKENS, outcome
    assert len(completed) >= REQUESTS * 0.95, figures

    # The ledger, killed and restarted meanwhile, counts exactly what the client received.
    received = sum(o.tokens for o in completed)

    def ledger_caught_up() -> dict | None:  # type: ignore[type-arg]
        totals = _ledger(mesh, "/v1/ledger/totals")
        return totals if totals["requests"]["completed"] >= len(completed) else None

    deadline = time.monotonic() + 60
    totals = None
    while totals is None and time.monotonic() < deadline:
        totals = await asyncio.to_thread(ledger_caught_up)
        await asyncio.sleep(0.5)
    assert totals is not None, "the ledger did not catch up"
    await asyncio.sleep(6)  # past the ledger's ack wait: a redelivery would have landed by now
    totals = _ledger(mesh, "/v1/ledger/totals")
    assert totals["requests"]["completed"] == len(completed)
    completed_tokens = sum(
        _ledger(mesh, f"/v1/ledger/requests/{o.request_id}")["completion_tokens"] for o in completed
    )
    assert completed_tokens == received
    for outcome in errors:  # what a client saw fail is not counted as served
        row = _ledger(mesh, f"/v1/ledger/requests/{outcome.request_id}")
        assert row.get("status") != "completed", (outcome, row)

    # The killed node comes back and rejoins the cluster.
    await asyncio.to_thread(cluster.restart_node, cluster.node_named(victim))
