"""The lifecycle exporter (examples/lifecycle_export.py) on the real NATS: every request's events
folded into one Parquet row, once, and the rows replayed by the simulator as a Mooncake trace."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest

from examples import lifecycle_export
from examples.lifecycle_export import LifecycleExporter, LifecycleFold, SavedState, to_mooncake_jsonl
from ripplemesh import Subscriber
from schemas.events import (
    AdmissionDecision,
    DecodeCompleted,
    Event,
    InferenceRequest,
    PrefillCompleted,
    RequestFailed,
    RequestMigrated,
    RequestPrepared,
    RequestRejected,
    RequestRouted,
    Usage,
    WorkflowRef,
    encode_event,
    new_event_id,
)
from schemas.subjects import LIFECYCLE, REQUESTS, event_subject, prepared_subject
from services.mesh.block_hash import chain_block_hashes
from services.mesh.bus import Bus
from services.mesh.embedded_nats import EmbeddedNats
from services.simulator import FleetSpec, PoolSpec, run_simulation
from services.simulator.core import RequestRecord
from services.simulator.workload import load_workload
from tests.conftest import replicas_for

TENANT = "acme"
MODEL = "llama-3-8b"


@pytest.fixture
async def bus(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bus]:
    """A NATS server of these tests' own: the requests they make up must not reach the services
    of a mesh another test started on the shared one (its admission would serve them)."""
    async with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        connected = await Bus.connect(server.url, "tests")
        await connected.provision()
        yield connected
        await connected.close()


BLOCK = 16


def prepared(
    request_id: str, tokens: list[int], max_tokens: int, submitted_at: float, **extra
) -> RequestPrepared:  # type: ignore[no-untyped-def]
    return RequestPrepared(
        event_id=new_event_id(),
        occurred_at=submitted_at,
        request=InferenceRequest(
            request_id=request_id,
            tenant=TENANT,
            model=MODEL,
            api="nats",
            prompt_tokens=tokens,
            block_size=BLOCK,
            block_hashes=chain_block_hashes(tokens, BLOCK, model=MODEL),
            max_tokens=max_tokens,
            submitted_at=submitted_at,
            **extra,
        ),
    )


def common(request_id: str, at: float) -> dict:  # type: ignore[type-arg]
    return {"event_id": new_event_id(), "occurred_at": at, "request_id": request_id, "tenant": TENANT}


def routed(request_id: str, at: float) -> RequestRouted:
    return RequestRouted(
        **common(request_id, at),
        mode="disaggregated",
        prefill_worker="prefill-0",
        decode_worker="decode-0",
        candidates=2,
        predicted_load=0.1,
    )


def prefilled(request_id: str, at: float, prompt: int, cached: int) -> PrefillCompleted:
    return PrefillCompleted(
        **common(request_id, at),
        worker_id="prefill-0",
        gpu_type="H100",
        gpu_seconds=0.02,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_s=0.15,
    )


def decoded(request_id: str, at: float, prompt: int, output: int) -> DecodeCompleted:
    return DecodeCompleted(
        **common(request_id, at),
        worker_id="decode-0",
        gpu_type="L40S",
        gpu_seconds=0.5,
        kv_transfer_bytes=1000,
        usage=Usage(prompt_tokens=prompt, completion_tokens=output),
        finish_reason="length",
        latency_s=1.25,
    )


def tokens(count: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 32000 for i in range(count)]


def parts(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("part-*.parquet"))


async def until(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.05)


def test_the_fold_counts_each_event_once_ignores_late_ones_and_drops_requests_that_never_end() -> None:
    now = [0.0]
    fold = LifecycleFold(settle_s=1.0, request_timeout_s=10.0, max_in_flight=3, clock=lambda: now[0])
    done = decoded("r1", 5.0, 100, 20)
    again = prefilled("r1", 2.0, 100, 16)  # a second prefill (after a migration, say)
    for event in (prefilled("r1", 1.0, 100, 0), again, again, done, done):
        fold.apply(event)
    assert fold.duplicates == 2 and list(fold.closing) == ["r1"]
    fold.apply(RequestFailed(**common("r1", 6.0), stage="decode", message="after the end"))
    fold.sweep()
    assert fold.ready == []  # settling: its RequestPrepared may still come
    fold.prepared(prepared("r1", tokens(100, 1), 20, 0.5))
    now[0] = 1.0
    fold.sweep()
    [row] = fold.take()
    assert row["status"] == "completed" and row["message"] is None  # the first end stands
    assert row["gpu_seconds"] == pytest.approx(0.54) and row["events"] == 5 and row["ttft_s"] == 0.15
    assert row["cached_tokens"] == 16 and row["prompt_tokens"] == 100 and row["model"] == MODEL
    fold.apply(done)  # redelivered after its row was written
    assert fold.late == 1 and not fold.open and not fold.take()
    # Never ending: dropped past the timeout, or the oldest beyond max_in_flight.
    for index in range(4):
        fold.apply(routed(f"open-{index}", 7.0))
    assert fold.dropped == 1 and list(fold.open) == ["open-1", "open-2", "open-3"]
    # What a durable exporter keeps over a stop: its requests in flight, and what it wrote.
    again = LifecycleFold(clock=lambda: now[0])
    again.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(fold.save()), type=SavedState))
    assert list(again.open) == ["open-1", "open-2", "open-3"] and "r1" in again.written
    again.apply(routed("open-1", 7.5))
    assert again.open["open-1"].events == 2
    now[0] = 11.0
    fold.sweep()
    assert fold.dropped == 4 and not fold.open


def test_the_example_runs_as_a_subscriber_writing_where_its_env_var_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert isinstance(lifecycle_export.exporter, Subscriber)
    monkeypatch.setenv(lifecycle_export.DIR_ENV, str(tmp_path))
    assert lifecycle_export.exporter.directory() == tmp_path
    spec = lifecycle_export.exporter.prepared_spec()
    assert (spec.stream, spec.filter_subject, spec.deliver) == ("REQUESTS", "rmesh.prepared.*", "new")
    assert spec.durable == "sub-lifecycle-export-prepared"


async def publish_twice(bus: Bus, subject: str, event: Event) -> None:
    """Published, then stored a second time under another message id: delivered twice."""
    await bus.publish(subject, event)
    await bus.js.publish(subject, encode_event(event), headers={"Nats-Msg-Id": f"again-{event.event_id}"})


async def test_every_request_is_one_row_and_the_export_replays_in_the_simulator(
    bus: Bus, tmp_path: Path
) -> None:
    out = tmp_path / "lifecycle"
    exporter = LifecycleExporter(
        f"test-export-{uuid.uuid4().hex[:8]}",
        durable=False,
        out_dir=out,
        flush_rows=2,
        flush_every_s=0.2,
        settle_s=0.3,
    )
    run = uuid.uuid4().hex[:6]
    ids = {name: f"{name}-{run}" for name in ("done", "shared", "failed", "rejected", "ingress", "open")}
    t0 = time.time()
    shared_prefix = tokens(600, 0)
    first = shared_prefix + tokens(400, 1)  # 1000 tokens: 62 blocks of 16
    second = shared_prefix + tokens(300, 2)  # 900 tokens: the first 512-token block in common
    await exporter.start(bus)
    try:
        e = event_subject
        r = ids["done"]
        await bus.publish(prepared_subject(TENANT), prepared(r, first, 64, t0, priority="critical"))
        await bus.publish(
            e("admission"),
            AdmissionDecision(
                **common(r, t0 + 0.01),
                admission="admission-0",
                outcome="admitted",
                reason="admitted",
                priority="critical",
                waited_s=0.01,
            ),
        )
        await bus.publish(e("routed"), routed(r, t0 + 0.02))
        await bus.publish(e("prefill_completed"), prefilled(r, t0 + 0.2, 1000, 0))
        await bus.publish(e("decode_completed"), decoded(r, t0 + 1.0, 1000, 50))

        r = ids["shared"]  # its RequestPrepared comes last; one event delivered twice
        workflow = WorkflowRef(workflow_id=f"wf-{run}", step=2, steps=3)
        await bus.publish(e("routed"), routed(r, t0 + 1.02))
        await bus.publish(e("prefill_completed"), prefilled(r, t0 + 1.1, 900, 512))
        migrated = RequestMigrated(
            **common(r, t0 + 1.2),
            migration=1,
            reason="worker_lost",
            from_worker="decode-0",
            from_phase="decode",
            resume_seq=3,
            delivered_tokens=3,
            remaining_tokens=37,
        )
        await publish_twice(bus, e("migrated"), migrated)
        completed = decoded(r, t0 + 2.0, 900, 40)
        await publish_twice(bus, e("decode_completed"), completed)
        await bus.publish(prepared_subject(TENANT), prepared(r, second, 40, t0 + 1.0, workflow=workflow))

        r = ids["failed"]
        await bus.publish(prepared_subject(TENANT), prepared(r, tokens(700, 3), 80, t0 + 2.0))
        await bus.publish(e("routed"), routed(r, t0 + 2.01))
        await bus.publish(
            e("failed"), RequestFailed(**common(r, t0 + 2.5), stage="prefill", worker_id="p-0", message="oom")
        )

        r = ids["rejected"]
        await bus.publish(prepared_subject(TENANT), prepared(r, tokens(300, 4), 30, t0 + 3.0))
        rejection = {"stage": "admission", "reason": "quota", "message": "over quota"}
        await bus.publish(e("rejected"), RequestRejected(**common(r, t0 + 3.01), **rejection))

        r = ids["ingress"]  # rejected before it was prepared: no prompt known
        invalid = {"stage": "ingress", "reason": "invalid", "message": "bad"}
        await bus.publish(e("rejected"), RequestRejected(**common(r, t0 + 3.5), **invalid))

        r = ids["open"]  # never ends
        await bus.publish(prepared_subject(TENANT), prepared(r, tokens(200, 5), 10, t0 + 4.0))
        await bus.publish(e("routed"), routed(r, t0 + 4.01))
        await until(lambda: exporter.writer is not None and exporter.writer.rows_written == 5)
    finally:
        await exporter.stop()
    assert exporter.fold.late == 0 and exporter.fold.dropped == 1  # the open one, at the stop
    assert len(parts(out)) >= 2  # batches of 2 rows

    rows = {row["request_id"]: row for row in pq.read_table(out).to_pylist()}
    assert sorted(rows) == sorted(ids[name] for name in ("done", "shared", "failed", "rejected", "ingress"))
    done, shared = rows[ids["done"]], rows[ids["shared"]]
    assert done["status"] == "completed" and done["priority"] == "critical" and done["model"] == MODEL
    assert (done["prompt_tokens"], done["cached_tokens"], done["output_tokens"]) == (1000, 0, 50)
    assert (done["prefill_gpu"], done["decode_gpu"], done["mode"]) == ("H100", "L40S", "disaggregated")
    assert done["ttft_s"] == 0.15 and done["latency_s"] == 1.25 and done["admission_wait_s"] == 0.01
    assert done["block_hashes"] == chain_block_hashes(first, BLOCK, model=MODEL) and done["events"] == 5
    # Delivered twice, counted once; its late RequestPrepared folded in.
    assert shared["events"] == 5 and shared["migrations"] == 1
    assert shared["gpu_seconds"] == pytest.approx(0.52) and shared["kv_transfer_bytes"] == 1000
    assert (shared["workflow_id"], shared["workflow_step"], shared["workflow_steps"]) == (f"wf-{run}", 2, 3)
    assert (shared["prompt_tokens"], shared["cached_tokens"], shared["max_tokens"]) == (900, 512, 40)
    assert rows[ids["failed"]]["status"] == "failed" and rows[ids["failed"]]["message"] == "oom"
    assert rows[ids["failed"]]["stage"] == "prefill" and rows[ids["failed"]]["output_tokens"] is None
    rejected = rows[ids["rejected"]]
    assert (rejected["status"], rejected["stage"], rejected["reason"]) == ("rejected", "admission", "quota")
    assert rows[ids["ingress"]]["prompt_tokens"] is None and rows[ids["ingress"]]["submitted_at"] is None

    # The Mooncake trace: arrival order, ms from the first, 512-token blocks shared by prefix.
    trace = tmp_path / "mesh.jsonl"
    export = to_mooncake_jsonl(out, trace)
    assert (export.written, export.skipped) == (4, 1)  # the ingress rejection has no prompt
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["timestamp"] for line in lines] == [0, 1000, 2000, 3000]
    assert [(line["input_length"], line["output_length"]) for line in lines] == [
        (1000, 50),
        (900, 40),
        (700, 80),  # not completed: what it asked for
        (300, 30),
    ]
    assert [line["hash_ids"] for line in lines] == [[0, 1], [0, 2], [3, 4], [5]]

    # Replayed by the simulator's own loader, request for request.
    workload = load_workload(str(trace), block_size=BLOCK)
    records: list[RequestRecord] = []
    spec = FleetSpec(pools=[PoolSpec(replicas=1)], gpu_prices_per_hour={"H100": 3.0})
    result = run_simulation(workload, spec, request_log=records.append, admission="none")
    assert result.requests == result.requests_completed == 4
    replayed = sorted((record.arrival, record.prompt_tokens, record.output_tokens) for record in records)
    assert [(p, o) for _, p, o in replayed] == [
        (line["input_length"], line["output_length"]) for line in lines
    ]
    assert [a for a, _, _ in replayed] == [0.0, 1.0, 2.0, 3.0]
    by_arrival = sorted(records, key=lambda record: record.arrival)
    assert by_arrival[1].cached_tokens >= 512  # the shared prefix, a cache hit in the replay too


async def test_a_durable_exporter_stopped_and_started_again_carries_its_requests_in_flight(
    bus: Bus, tmp_path: Path
) -> None:
    name = f"test-export-{uuid.uuid4().hex[:8]}"

    def exporter() -> LifecycleExporter:
        return LifecycleExporter(name, out_dir=tmp_path, flush_every_s=0.1, settle_s=0.2)

    run = uuid.uuid4().hex[:6]
    done, open_ = f"done-{run}", f"open-{run}"
    t0 = time.time()
    completed = decoded(done, t0 + 1.0, 100, 10)
    first = exporter()
    await first.start(bus)
    try:
        await bus.publish(prepared_subject(TENANT), prepared(done, tokens(100, 6), 10, t0))
        await bus.publish(event_subject("decode_completed"), completed)
        await bus.publish(prepared_subject(TENANT), prepared(open_, tokens(200, 7), 20, t0 + 0.5))
        await bus.publish(event_subject("routed"), routed(open_, t0 + 0.6))
        await until(lambda: first.writer is not None and first.writer.rows_written == 1)
        await until(lambda: open_ in first.fold.open and first.fold.open[open_].events == 2)
    finally:
        await first.stop()
    assert first.fold.dropped == 0 and (tmp_path / lifecycle_export.STATE_FILE).exists()
    second = exporter()
    await second.start(bus)
    try:
        assert open_ in second.fold.open and not (tmp_path / lifecycle_export.STATE_FILE).exists()
        await publish_twice(bus, event_subject("decode_completed"), completed)  # its row is written
        await bus.publish(event_subject("decode_completed"), decoded(open_, t0 + 2.0, 200, 20))
        await until(lambda: second.writer is not None and second.writer.rows_written == 1)
        await until(lambda: second.fold.late >= 1)
    finally:
        await second.stop()
        for stream, durable in (
            (LIFECYCLE.name, second.spec().durable),
            (REQUESTS.name, second.prepared_spec().durable),
        ):
            await bus.js.delete_consumer(stream, durable)
    assert parts(tmp_path) == ["part-000000.parquet", "part-000001.parquet"]  # numbered on
    rows = {row["request_id"]: row for row in pq.read_table(tmp_path).to_pylist()}
    assert sorted(rows) == sorted([done, open_])
    assert (rows[open_]["prompt_tokens"], rows[open_]["output_tokens"], rows[open_]["events"]) == (200, 20, 3)
    assert rows[open_]["model"] == MODEL and rows[open_]["mode"] == "disaggregated"


async def test_as_the_subscribers_user_it_exports_without_the_prompts_or_says_what_it_needs(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # On the shared server, which has the users: only lifecycle events are made up here.
    assert nats_server.auth is not None and nats_server.auth.subscribers is not None
    bus = await Bus.connect(
        nats_server.url, "tests", credentials=nats_server.auth.service, replicas=replicas_for(nats_server)
    )
    await bus.provision()
    own = await Bus.connect(nats_server.url, "subscriber", credentials=nats_server.auth.subscribers)
    try:
        denied = LifecycleExporter(f"test-export-{uuid.uuid4().hex[:8]}", durable=False, out_dir=tmp_path)
        with pytest.raises(RuntimeError, match="services' NATS user"):
            await denied.start(own)
        exporter = LifecycleExporter(
            f"test-export-{uuid.uuid4().hex[:8]}",
            durable=False,
            out_dir=tmp_path,
            read_prepared=False,
            flush_every_s=0.1,
            settle_s=0.1,
        )
        await exporter.start(own)
        try:
            request_id = f"r-{uuid.uuid4().hex[:6]}"
            await bus.publish(event_subject("prefill_completed"), prefilled(request_id, time.time(), 300, 0))
            await bus.publish(event_subject("decode_completed"), decoded(request_id, time.time(), 300, 8))
            await until(lambda: exporter.writer is not None and exporter.writer.rows_written == 1)
        finally:
            await exporter.stop()
    finally:
        await own.close()
        await bus.close()
    [row] = pq.read_table(tmp_path).to_pylist()
    assert (row["prompt_tokens"], row["output_tokens"], row["block_hashes"]) == (300, 8, None)
