"""The router's KV index kept current over real NATS: from workers' events and dumps, through lost,
duplicated and malformed batches, unknown, silent, dead and restarted workers; and in the mesh, the
router's decision span predicting the cached prefix the prefill then finds, also after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from prometheus_client import REGISTRY

from ripplemesh.client import MeshClient
from ripplemesh.launcher import Mesh
from ripplemesh.traces import load_request_trace
from schemas.events import InferenceRequest, KvCacheChange, KvDump, KvEvents, WorkerState, encode_event
from schemas.subjects import kv_dump_subject, kv_subject
from services.engines.base import RealClock
from services.engines.host import EngineHost
from services.engines.sim.engine import SimEngine
from services.mesh import kv_dump
from services.mesh.block_hash import chain_block_hashes
from services.mesh.bus import Bus
from services.mesh.config import load_config
from services.mesh.embedded_nats import EmbeddedNats
from services.mesh.runtime import Runtime, ServiceOptions
from services.router.kv_index import KvIndex, Outcome
from services.router.kv_sync import KvSync
from services.router.service import view_of
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "llama-3-8b"
BLOCK_SIZE = 16


class FakeWorker:
    """A worker's prefix-cache side as services/engines/host.py publishes it: numbered batches on
    rmesh.kv.<worker>, and a dump responder that flushes pending changes first."""

    def __init__(self, nc: NatsClient, worker_id: str, *, block_size: int = BLOCK_SIZE, respond: bool = True):
        self.nc = nc
        self.worker_id = worker_id
        self.block_size = block_size
        self.respond = respond
        self.blocks: set[int] = set()
        self.seq = 0
        self.started_at = time.time()
        self.dump_requests = 0
        self._pending: list[KvCacheChange] = []
        self._sub: Any = None

    async def start(self) -> FakeWorker:
        self._sub = await self.nc.subscribe(kv_dump_subject(self.worker_id), cb=self._on_dump)
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def store(self, *hashes: int) -> None:
        self.blocks.update(hashes)
        self._pending.append(KvCacheChange(kind="stored", block_hashes=list(hashes)))

    def remove(self, *hashes: int) -> None:
        self.blocks.difference_update(hashes)
        self._pending.append(KvCacheChange(kind="removed", block_hashes=list(hashes)))

    def _batch(self) -> KvEvents | None:
        if not self._pending:
            return None
        self.seq += 1
        changes, self._pending = self._pending, []
        return KvEvents(
            event_id=f"{self.worker_id}-kv-{self.seq}",
            occurred_at=time.time(),
            worker_id=self.worker_id,
            model=MODEL,
            block_size=self.block_size,
            seq=self.seq,
            changes=changes,
            started_at=self.started_at,
        )

    async def flush(self, *, lose: bool = False) -> KvEvents | None:
        batch = self._batch()
        if batch is not None and not lose:
            await self.nc.publish(kv_subject(self.worker_id), encode_event(batch))
            await self.nc.flush()
        return batch

    async def _on_dump(self, msg: Msg) -> None:
        self.dump_requests += 1
        if not self.respond:
            return
        batch = self._batch()
        dump = KvDump(
            event_id=f"{self.worker_id}-dump-{time.monotonic_ns()}",
            occurred_at=time.time(),
            worker_id=self.worker_id,
            model=MODEL,
            block_size=self.block_size,
            seq=self.seq,
            block_hashes=sorted(self.blocks),
            started_at=self.started_at,
        )
        if batch is not None:
            await self.nc.publish(kv_subject(self.worker_id), encode_event(batch))
        await msg.respond(encode_event(dump))

    def heartbeat(self, *, at: float | None = None) -> WorkerState:
        now = time.time() if at is None else at
        return WorkerState(
            event_id=f"{self.worker_id}-{time.monotonic_ns()}",
            occurred_at=now,
            worker_id=self.worker_id,
            role="prefill",
            pool="test",
            model=MODEL,
            engine="fake",
            gpu_type="H100",
            price_per_hour=1.0,
            block_size=self.block_size,
            kv_blocks_total=1000,
            kv_blocks_used=len(self.blocks),
            kv_blocks_cached=len(self.blocks),
            queue_depth=0,
            running=0,
            tokens_per_s=0.0,
            started_at=self.started_at,
        )


def forged_batch(worker: FakeWorker, seq: int, stored: int, **fields: Any) -> KvEvents:
    """A batch on the worker's subject that the worker did not send: one stored block, at `seq`,
    otherwise as the worker's own (`fields` override)."""
    base: dict[str, Any] = {
        "event_id": f"forged-{seq}-{stored}",
        "occurred_at": time.time(),
        "worker_id": worker.worker_id,
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "seq": seq,
        "changes": [KvCacheChange(kind="stored", block_hashes=[stored])],
    }
    return KvEvents(**{**base, **fields})


def counted(metric: str, outcome: str) -> float:
    return REGISTRY.get_sample_value(metric, {"outcome": outcome}) or 0.0


async def eventually(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.02)


def current(index: KvIndex, worker: FakeWorker) -> bool:
    return index.synced(worker.worker_id) and index.blocks_of(worker.worker_id) == worker.blocks


@pytest.fixture
async def sync(bus: Bus) -> AsyncIterator[KvSync]:
    kv_sync = KvSync(bus.nc, KvIndex(BLOCK_SIZE), dump_timeout_s=0.5, liveness_s=60.0)
    task = asyncio.create_task(kv_sync.run())
    await asyncio.wait_for(kv_sync.subscribed.wait(), 5)
    yield kv_sync
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


def worker_name(label: str) -> str:
    return f"kvt-{label}-{uuid.uuid4().hex[:6]}"


# ---------------------------------------------------------------- KvSync over NATS


async def discovered_worker(bus: Bus, sync: KvSync, label: str) -> FakeWorker:
    """A worker with blocks 1-3 cached before the router knew it, in the index from its dump."""
    worker = await FakeWorker(bus.nc, worker_name(label)).start()
    worker.store(1, 2, 3)
    await worker.flush(lose=True)
    sync.observe(worker.heartbeat())
    await eventually(lambda: current(sync.index, worker))
    return worker


async def test_index_follows_a_worker_through_lost_duplicated_and_bad_batches(bus: Bus, sync: KvSync) -> None:
    index = sync.index
    # Blocks cached before the router knew the worker: they come from its dump (discovery).
    worker = await discovered_worker(bus, sync, "a")
    assert index.seq(worker.worker_id) == 1 and worker.dump_requests >= 1

    # (A mesh's router on the same server, if one runs, asks for dumps too: count only ours.)
    applied_dumps = counted("ripplemesh_router_kv_dumps_total", "applied")
    worker.store(4, 5)
    await worker.flush()
    await eventually(lambda: current(index, worker) and index.seq(worker.worker_id) == 2)

    # A lost batch: the next one is a gap, and a dump brings the index back.
    gaps = counted("ripplemesh_router_kv_events_total", "gap")
    worker.remove(1)
    await worker.flush(lose=True)
    worker.store(6)
    await worker.flush()
    await eventually(lambda: current(index, worker) and index.seq(worker.worker_id) == worker.seq)
    assert counted("ripplemesh_router_kv_events_total", "gap") >= gaps + 1
    assert counted("ripplemesh_router_kv_dumps_total", "applied") >= applied_dumps + 1

    # A duplicate, garbage, a batch on another worker's subject, a mismatched block size.
    duplicates = counted("ripplemesh_router_kv_events_total", "duplicate")
    invalid = counted("ripplemesh_router_kv_events_total", "invalid")
    mismatches = counted("ripplemesh_router_kv_events_total", "mismatch")
    worker.store(7)
    batch = await worker.flush()
    assert batch is not None
    await bus.nc.publish(kv_subject(worker.worker_id), encode_event(batch))
    await bus.nc.publish(kv_subject(worker.worker_id), b"{not json")
    await bus.nc.publish(kv_subject(worker_name("other")), encode_event(batch))
    wrong = forged_batch(worker, worker.seq + 1, 99, block_size=BLOCK_SIZE * 2)
    await bus.nc.publish(kv_subject(worker.worker_id), encode_event(wrong))
    await bus.nc.flush()
    await eventually(lambda: counted("ripplemesh_router_kv_events_total", "mismatch") >= mismatches + 1)
    assert counted("ripplemesh_router_kv_events_total", "duplicate") >= duplicates + 1
    assert counted("ripplemesh_router_kv_events_total", "invalid") >= invalid + 2
    # The mismatch dropped the worker's blocks (they cannot be trusted) and resynced it.
    await eventually(lambda: current(index, worker))
    assert 99 not in index.blocks_of(worker.worker_id)
    assert index.overlaps([1]) == {} and index.overlaps([2, 3, 4]) == {worker.worker_id: 3}

    # A batch numbered far past the worker's (a broken producer): counted, one dump resyncs the
    # worker, and the router then stops asking for dumps.
    ahead = counted("ripplemesh_router_kv_events_total", "ahead")
    far = forged_batch(worker, worker.seq + 10**9, 98)
    await bus.nc.publish(kv_subject(worker.worker_id), encode_event(far))
    await bus.nc.flush()
    await eventually(lambda: counted("ripplemesh_router_kv_events_total", "ahead") >= ahead + 1)
    await eventually(lambda: current(index, worker))
    requests = worker.dump_requests
    worker.store(8)
    await worker.flush()
    await eventually(lambda: current(index, worker) and index.seq(worker.worker_id) == worker.seq)
    await asyncio.sleep(0.5)
    assert worker.dump_requests == requests and 98 not in index.blocks_of(worker.worker_id)
    await worker.stop()


async def test_two_router_replicas_build_the_same_index_from_the_same_events(bus: Bus) -> None:
    # Active-active: each replica reads every worker's events and dumps on its own, through a
    # lost batch and a worker it discovers late, and each ends with the workers' caches.
    syncs = [KvSync(bus.nc, KvIndex(BLOCK_SIZE), dump_timeout_s=0.5, liveness_s=60.0) for _ in range(2)]
    tasks = [asyncio.create_task(s.run()) for s in syncs]
    workers: list[FakeWorker] = []
    try:
        await asyncio.wait_for(asyncio.gather(*(s.subscribed.wait() for s in syncs)), 5)
        workers = [await FakeWorker(bus.nc, worker_name(f"rep{i}")).start() for i in range(3)]
        for i, worker in enumerate(workers):
            worker.store(*range(10 * i, 10 * i + 8))
            await worker.flush()
            for s in syncs:
                s.observe(worker.heartbeat())
        workers[0].remove(0, 1)
        await workers[0].flush(lose=True)  # a gap: each replica resyncs from a dump
        workers[0].store(99)
        await workers[0].flush()
        late = await FakeWorker(bus.nc, worker_name("late")).start()
        late.store(7, 8)
        await late.flush()
        syncs[1].observe(late.heartbeat())  # one replica hears its heartbeat first
        syncs[0].observe(late.heartbeat())
        workers.append(late)
        for s in syncs:
            await eventually(lambda s=s: all(current(s.index, w) for w in workers))
        a, b = (s.index for s in syncs)
        assert all(a.blocks_of(w.worker_id) == b.blocks_of(w.worker_id) for w in workers)
        probe = [*range(2, 8), 99]  # worker 0's blocks since the gap
        assert a.overlaps(probe) == b.overlaps(probe) == {workers[0].worker_id: 7}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.stop()


def kv_events_counted() -> float:
    """KV event batches the router has counted, whatever their outcome."""
    outcomes = (*(outcome.value for outcome in Outcome), "ahead", "invalid", "dead_worker", "error")
    return sum(counted("ripplemesh_router_kv_events_total", outcome) for outcome in outcomes)


def hostile_kv_payload(rng: random.Random, worker_id: str, seq: int) -> bytes:
    """Something a broken producer could put on a worker's KV subject: bytes, JSON of the wrong
    shape, or KvEvents out of turn (a seq already applied, or far ahead), for another worker,
    model or block size, or with one field out of range. (Not a batch numbered as the worker's
    next few: the index takes the worker's numbering on trust, so only the subject's publish
    permission keeps such a forgery out.)"""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 64))
    if kind == 1:
        return json.dumps(rng.choice([[], {}, None, 3, "x", {"worker_id": worker_id}, {"seq": -1}])).encode()
    fields: dict[str, Any] = {
        "type": "kv.events.v1",
        "event_id": uuid.uuid4().hex,
        "occurred_at": time.time(),
        "worker_id": worker_id,
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "seq": rng.choice([seq, seq - 1, 1, seq + 10**9]),
        "changes": [
            {"kind": rng.choice(["stored", "removed", "cleared"]), "block_hashes": [rng.randrange(200, 300)]}
            for _ in range(rng.randrange(3))
        ],
    }
    if kind == 3:  # for another worker, model or block size
        key, value = rng.choice([("worker_id", "someone-else"), ("model", "other-model"), ("block_size", 32)])
        fields[key] = value
    elif kind == 4:  # one field out of range or of the wrong type
        out_of_range = [("seq", -5), ("seq", 2**70), ("block_size", 0), ("occurred_at", "soon")]
        key, value = rng.choice([*out_of_range, ("changes", {"kind": "x"})])
        fields[key] = value
    elif kind == 5:
        fields.pop(rng.choice(sorted(fields)))
    return json.dumps(fields).encode()


async def test_hostile_kv_payloads_never_stop_the_sync_or_leave_a_wrong_index(
    bus: Bus, sync: KvSync, caplog: pytest.LogCaptureFixture
) -> None:
    # A real worker, synced; then 400 hostile payloads on its subject over NATS, between its
    # own batches. The sync keeps running, every payload is counted, bad ones are logged, and
    # afterwards the index holds exactly the worker's cache (resynced where it had to be).
    index = sync.index
    worker = await discovered_worker(bus, sync, "hostile")
    total = kv_events_counted()
    rng = random.Random(2026)
    sent = 0
    for round_ in range(8):
        for _ in range(50):
            data = hostile_kv_payload(rng, worker.worker_id, worker.seq)
            await bus.nc.publish(kv_subject(worker.worker_id), data)
            sent += 1
        worker.store(100 + round_)
        await worker.flush()
        sent += 1
        await bus.nc.flush()
    await eventually(lambda: kv_events_counted() >= total + sent, timeout_s=20)
    sync.observe(worker.heartbeat())
    caught_up = lambda: current(index, worker) and index.seq(worker.worker_id) == worker.seq  # noqa: E731
    await eventually(caught_up, timeout_s=20)
    index.check_invariants()
    assert index.blocks_of(worker.worker_id) == worker.blocks
    assert any("KV events" in record.getMessage() for record in caplog.records)
    await worker.stop()


async def test_unknown_silent_dead_and_restarted_workers(bus: Bus) -> None:
    index = KvIndex(BLOCK_SIZE)
    sync = KvSync(bus.nc, index, dump_timeout_s=0.3, liveness_s=0.6, unannounced_grace_s=0.8)
    task = asyncio.create_task(sync.run())
    await asyncio.wait_for(sync.subscribed.wait(), 5)
    try:
        # Events from a worker with no heartbeat: discovered by its dump, dropped after the grace.
        stranger = await FakeWorker(bus.nc, worker_name("stranger")).start()
        stranger.store(10, 11)
        await stranger.flush()
        await eventually(lambda: current(index, stranger))
        await eventually(lambda: stranger.worker_id not in index, timeout_s=5)
        stranger.store(12)
        await stranger.flush()  # ignored: the router holds it for gone
        await asyncio.sleep(0.2)
        assert stranger.worker_id not in index

        # A worker whose heartbeats stop: dropped after the liveness window.
        worker = await FakeWorker(bus.nc, worker_name("b")).start()
        worker.store(1, 2)
        await worker.flush()
        sync.observe(worker.heartbeat())
        await eventually(lambda: current(index, worker))
        await eventually(lambda: worker.worker_id not in index, timeout_s=5)
        # It comes back (a fresh heartbeat): resynced from a dump.
        sync.observe(worker.heartbeat())
        await eventually(lambda: current(index, worker))

        # Restarted: a new incarnation with an empty cache replaces the old blocks.
        restarted = FakeWorker(bus.nc, worker.worker_id)
        restarted.started_at = worker.started_at + 1.0
        await worker.stop()
        await restarted.start()
        restarted.store(7)
        # Its batch 1 (numbered from 1 again) comes before its heartbeat: a new incarnation, not
        # a duplicate of the old batch 1; the old blocks go and a dump brings the new ones.
        restarted_before = counted("ripplemesh_router_kv_events_total", "restarted")
        await restarted.flush()
        await eventually(lambda: current(index, restarted))
        assert index.blocks_of(worker.worker_id) == {7}
        assert counted("ripplemesh_router_kv_events_total", "restarted") >= restarted_before + 1
        # A late batch of the old incarnation changes nothing.
        stale = forged_batch(worker, restarted.seq + 1, 66, started_at=worker.started_at)
        await bus.nc.publish(kv_subject(worker.worker_id), encode_event(stale))
        sync.observe(restarted.heartbeat())
        await eventually(lambda: current(index, restarted))
        assert index.blocks_of(worker.worker_id) == {7}

        # Its WORKERS entry deleted (it stopped): dropped at once.
        sync.forget(restarted.worker_id)
        assert restarted.worker_id not in index

        # A heartbeat already stale when seen (a dead worker's last entry): never indexed.
        ghost = await FakeWorker(bus.nc, worker_name("ghost")).start()
        ghost.store(5)
        sync.observe(ghost.heartbeat(at=time.time() - 5.0))
        await asyncio.sleep(0.3)
        assert ghost.worker_id not in index and ghost.dump_requests == 0
        assert not task.done()
        await restarted.stop()
        await stranger.stop()
        await ghost.stop()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_dump_failures_back_off_and_recover(bus: Bus, sync: KvSync) -> None:
    index = sync.index
    # No responder at all, then one that never answers, then a real one.
    name = worker_name("late")
    no_responders = counted("ripplemesh_router_kv_dumps_total", "no_responders")
    timeouts = counted("ripplemesh_router_kv_dumps_total", "timeout")
    heartbeat = FakeWorker(bus.nc, name)
    sync.observe(heartbeat.heartbeat())
    await eventually(
        lambda: counted("ripplemesh_router_kv_dumps_total", "no_responders") >= no_responders + 2
    )
    assert index.needs_dump(name) and index.block_count(name) == 0
    mute = await FakeWorker(bus.nc, name, respond=False).start()
    await eventually(lambda: counted("ripplemesh_router_kv_dumps_total", "timeout") >= timeouts + 1)
    await mute.stop()
    worker = await FakeWorker(bus.nc, name).start()
    worker.store(3, 4)
    await worker.flush(lose=True)
    sync.observe(worker.heartbeat())
    await eventually(lambda: current(index, worker), timeout_s=15)

    # A worker whose cache uses another block size is never indexed.
    mismatched = await FakeWorker(bus.nc, worker_name("bs"), block_size=BLOCK_SIZE * 2).start()
    mismatched.store(8)
    await mismatched.flush(lose=True)
    before = counted("ripplemesh_router_kv_dumps_total", "mismatch")
    sync.observe(mismatched.heartbeat())
    await eventually(lambda: counted("ripplemesh_router_kv_dumps_total", "mismatch") >= before + 1)
    assert index.excluded(mismatched.worker_id) and index.overlaps([8]) == {}
    await worker.stop()
    await mismatched.stop()


# ---------------------------------------------------------------- dumps in chunks


def test_a_dump_splits_and_reassembles_and_mixed_chunks_are_refused() -> None:
    whole = KvDump(
        event_id="d",
        occurred_at=1.0,
        worker_id="w",
        model=MODEL,
        block_size=BLOCK_SIZE,
        seq=9,
        block_hashes=list(range(10)),
        started_at=5.0,
    )
    chunks = kv_dump.split(whole, 4)
    assert [c.block_hashes for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert {(c.chunk, c.chunks) for c in chunks} == {(0, 3), (1, 3), (2, 3)}
    # Any order, duplicates ignored.
    assembled = kv_dump.assemble([chunks[2], chunks[0], chunks[2], chunks[1]])
    assert msgspec.structs.replace(assembled, event_id=whole.event_id) == whole
    assert kv_dump.split(msgspec.structs.replace(whole, block_hashes=[]), 4)[0].chunks == 1
    incomplete = kv_dump.Assembler()
    incomplete.add(chunks[0])
    assert not incomplete.complete
    with pytest.raises(kv_dump.DumpError):
        incomplete.dump()
    other_seq = msgspec.structs.replace(chunks[1], seq=10)
    with pytest.raises(kv_dump.DumpError, match="does not belong"):
        kv_dump.assemble([chunks[0], other_seq])
    with pytest.raises(kv_dump.DumpError):
        kv_dump.assemble([msgspec.structs.replace(chunks[0], chunk=3)])
    # One message of 1 MiB holds about 50,000 hashes; a full-size hash takes 20 bytes in JSON.
    assert 45_000 < kv_dump.max_blocks_for(1024 * 1024) < 50_000
    full = msgspec.structs.replace(whole, block_hashes=[2**63 - 1] * kv_dump.max_blocks_for(1024 * 1024))
    assert len(encode_event(full)) <= 1024 * 1024


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A NATS server of this module's own: no mesh's router sees these workers."""
    server = EmbeddedNats(tmp_path_factory.mktemp("nats-kv")).start()
    yield server
    server.stop()


@dataclass
class HostedEngine:
    """A real engine host, started, and a router's KV index with the KvSync that fills it."""

    host: EngineHost
    index: KvIndex
    sync: KvSync
    _reading: asyncio.Task[None] | None = None

    async def read(self) -> None:
        """Start the router's side: subscribe to the worker's KV events, as a router does."""
        self._reading = asyncio.create_task(self.sync.run())
        await asyncio.wait_for(self.sync.subscribed.wait(), 5)


@contextlib.asynccontextmanager
async def hosted(
    nats: EmbeddedNats, config_path: Path, data_dir: Path, engine: SimEngine, label: str, **host_options: Any
) -> AsyncIterator[HostedEngine]:
    bus = await Bus.connect(nats.url, f"kv-{label}-test")
    await bus.provision()
    options = ServiceOptions(nats_url=nats.url, data_dir=data_dir, config=load_config(config_path))
    runtime = Runtime("prefill", options, bus)
    host = EngineHost(
        runtime, engine, worker_id=worker_name(label), role="prefill", pool="test", **host_options
    )
    index = KvIndex(BLOCK_SIZE)
    hosted_engine = HostedEngine(host, index, KvSync(bus.nc, index, dump_timeout_s=5.0, liveness_s=60.0))
    try:
        await host.start()
        yield hosted_engine
    finally:
        if hosted_engine._reading is not None:
            hosted_engine._reading.cancel()
            await asyncio.gather(hosted_engine._reading, return_exceptions=True)
        await asyncio.wait_for(host.stop(), 15)
        await runtime.cancel_tasks()
        await bus.close()


def prompt_request(request_id: str, tokens: list[int]) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id,
        tenant="acme",
        model=MODEL,
        api="nats",
        prompt_tokens=tokens,
        block_size=BLOCK_SIZE,
        block_hashes=chain_block_hashes(tokens, BLOCK_SIZE, model=MODEL),
        max_tokens=1,
        submitted_at=time.time(),
    )


async def test_a_cache_of_over_100k_blocks_reaches_the_index_in_chunks(
    own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    """A real engine host (sim engine) holding 127,500 blocks: one reply would exceed the
    server's 1 MiB payload limit; the router's KvSync gets every block, in chunks."""
    engine = SimEngine(
        model=MODEL,
        block_size=BLOCK_SIZE,
        clock=RealClock(0.0),
        kv_capacity_tokens=2_100_000,
        max_context_tokens=4096,
    )
    async with hosted(own_nats, test_config, tmp_path, engine, "big") as hosted_engine:
        host, index, sync = hosted_engine.host, hosted_engine.index, hosted_engine.sync
        rng = random.Random(7)

        async def prefill(i: int) -> None:
            request = prompt_request(f"fill-{i}", [rng.randrange(1000) for _ in range(4000)])
            await engine.prefill(request)
            engine.release(request.request_id)

        for start in range(0, 510, 30):
            # Bounded, so a stuck fill says so rather than running into the test's timeout.
            await asyncio.wait_for(asyncio.gather(*(prefill(i) for i in range(start, start + 30))), 30)
        cached = set(engine.cached_block_hashes())
        assert len(cached) > 100_000
        # Its heartbeat, as the router reads it: nothing held, but nearly every block caches a
        # prefix, so a placement there evicts (the memory-headroom axis needs the free count).
        view = view_of(host.state())
        assert view.kv_blocks_used == 0 and view.queued_tokens == 0 and view.context_tokens == 0
        assert view.kv_blocks_free == engine.info.kv_blocks_total - len(cached)
        whole = KvDump(
            event_id="x",
            occurred_at=time.time(),
            worker_id=host.worker_id,
            model=MODEL,
            block_size=BLOCK_SIZE,
            seq=host.kv_seq,
            block_hashes=sorted(cached),
            started_at=host.started_at,
        )
        assert len(encode_event(whole)) > host.runtime.bus.nc.max_payload  # one reply could not carry it
        await asyncio.sleep(0.2)  # the fill's batches go out before the reader subscribes

        applied = counted("ripplemesh_router_kv_dumps_total", "applied")
        await hosted_engine.read()
        sync.observe(host.state())  # discovery: the index knows nothing of it, so it asks for a dump
        await eventually(lambda: index.synced(host.worker_id) and index.block_count(host.worker_id) > 0, 20)
        assert index.blocks_of(host.worker_id) == cached
        assert index.started_at(host.worker_id) == host.started_at
        assert counted("ripplemesh_router_kv_dumps_total", "applied") == applied + 1


async def test_a_prefills_blocks_reach_the_index_when_it_ends_not_at_the_next_tick(
    own_nats: EmbeddedNats, test_config: Path, tmp_path: Path
) -> None:
    """A real engine host whose periodic KV publish is a minute apart: the router's index holds
    a prefill's prompt blocks as soon as the prefill ends, so a request sharing the prefix that
    comes right after it is placed knowing where it is cached."""
    engine = SimEngine(model=MODEL, block_size=BLOCK_SIZE, clock=RealClock(0.0), max_context_tokens=4096)
    async with hosted(
        own_nats, test_config, tmp_path, engine, "prompt", kv_events_every_s=60.0
    ) as hosted_engine:
        host, index, sync = hosted_engine.host, hosted_engine.index, hosted_engine.sync
        await hosted_engine.read()
        heartbeat = host.state()
        assert heartbeat.time_scale == 0.0  # its GPU work takes no wall time; the router knows
        sync.observe(heartbeat)  # discovery: its dump, empty, makes it synced
        await eventually(lambda: index.synced(host.worker_id), 10)
        assert index.block_count(host.worker_id) == 0

        rng = random.Random(11)
        request = prompt_request("prompt-1", [rng.randrange(1000) for _ in range(40 * BLOCK_SIZE)])
        await asyncio.wait_for(host.prefill(request, "source-prompt-1"), 30)
        # Well before the next tick (a minute away), the index has every block of the prompt.
        await eventually(lambda: index.overlap(host.worker_id, request.block_hashes) == 40, 5)
        assert index.synced(host.worker_id)
        engine.release(request.request_id)


# ---------------------------------------------------------------- in the mesh

WORDS = "the model token cache request worker batch prefill decode latency cost router queue fleet".split()


def long_prompt(words: int = 400) -> str:
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def router_health(mesh: Mesh) -> dict[str, Any]:
    with urllib.request.urlopen(f"{mesh.child('router').url}/healthz", timeout=5) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def decide_span(mesh: Mesh, request_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        spans = load_request_trace(mesh.data_dir, request_id)
        return next((s for s in spans if s["name"] == "router.decide"), None)

    return wait_until(find, timeout_s=15)  # type: ignore[no-any-return]


def indexed_blocks(mesh: Mesh, worker_id: str) -> int:
    entry = router_health(mesh)["kv_index"]["by_worker"].get(worker_id)
    return int(entry["blocks"]) if entry and entry["synced"] else 0


def all_indexed_blocks(mesh: Mesh) -> dict[str, int]:
    return {w: e["blocks"] for w, e in router_health(mesh)["kv_index"]["by_worker"].items() if e["synced"]}


async def test_router_predicts_the_cached_prefix_a_repeated_prompt_finds(mesh: Mesh) -> None:
    prompt = long_prompt()
    baseline = all_indexed_blocks(mesh)
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        first = await client.complete(prompt=prompt, max_tokens=4)
        assert first.usage.cached_tokens == 0
        first_span = decide_span(mesh, first.request_id)["attributes"]
        assert first_span["ripple.router.predicted_cached_tokens"] == 0
        worker = first_span["ripple.router.prefill_worker"]
        expected = baseline.get(worker, 0) + first.usage.prompt_tokens // 16
        # The worker's batches of stored blocks reach the router within a few tens of ms.
        await asyncio.to_thread(wait_until, lambda: indexed_blocks(mesh, worker) >= expected, 10)
        second = await client.complete(prompt=prompt, max_tokens=4)
    span = decide_span(mesh, second.request_id)["attributes"]
    assert span["ripple.router.prefill_worker"] == worker
    predicted = span["ripple.router.predicted_cached_tokens"]
    assert predicted > 0
    assert predicted == second.usage.cached_tokens  # the prediction is exactly what prefill found
    assert any(entry.startswith(f"{worker}=") for entry in span["ripple.router.cached_tokens_by_worker"])


async def test_router_restart_rebuilds_the_index_from_dumps(mesh: Mesh) -> None:
    prompt = long_prompt()
    baseline = all_indexed_blocks(mesh)
    async with MeshClient(mesh.url, "acme", credentials=mesh.credentials("acme")) as client:
        first = await client.complete(prompt=prompt, max_tokens=4)
        worker = decide_span(mesh, first.request_id)["attributes"]["ripple.router.prefill_worker"]
        expected = baseline.get(worker, 0) + first.usage.prompt_tokens // 16
        await asyncio.to_thread(wait_until, lambda: indexed_blocks(mesh, worker) >= expected, 10)
        await asyncio.sleep(0.3)  # let every batch land
        # The mesh's own workers (other tests' fake ones on this server have no heartbeat).
        workers = {c.name for c in mesh.children if c.name.startswith(("prefill-", "decode-"))}
        before = {w: n for w, n in all_indexed_blocks(mesh).items() if w in workers}
        assert before.get(worker, 0) >= expected
        await asyncio.to_thread(mesh.restart_child, "router")
        # Nothing new is cached meanwhile: only the workers' dumps can tell the new router process.
        await asyncio.to_thread(
            wait_until, lambda: all(indexed_blocks(mesh, w) == n for w, n in before.items()), 15
        )
        with urllib.request.urlopen(f"{mesh.child('router').url}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        assert 'ripplemesh_router_kv_dumps_total{outcome="applied"}' in metrics
        again = await client.complete(prompt=prompt, max_tokens=4)
    span = decide_span(mesh, again.request_id)["attributes"]
    assert span["ripple.router.predicted_cached_tokens"] == again.usage.cached_tokens > 0
