"""LedgerStore against a real SQLite file and a real PostgreSQL (one fresh schema per test)."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from schemas.events import (
    DecodeCompleted,
    FleetObserved,
    LifecycleEvent,
    PoolView,
    PrefillCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    RouteDecision,
    RouteOption,
    Usage,
)
from services.ledger import store as store_module
from services.ledger.pricing import PricingError, price_gpu_seconds
from services.ledger.store import MIGRATIONS, LedgerStore

PG_URL = os.environ.get("RIPPLEMESH_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")

PRICES = {"h100": 3.60, "a10g": 1.20}
H100_PER_S = 3.60 / 3600
A10G_PER_S = 1.20 / 3600

T0 = 1_700_000_000.0


# ---------------------------------------------------------------- fixtures


@contextlib.asynccontextmanager
async def fresh_database(kind: str, path: Path) -> AsyncIterator[dict[str, Any]]:
    """Keyword arguments for `LedgerStore.open`: the SQLite file `path`, or a fresh PostgreSQL
    schema (skips the test when the server cannot be reached)."""
    if kind == "sqlite":
        yield {"url": f"sqlite+aiosqlite:///{path}"}
        return
    asyncpg = pytest.importorskip("asyncpg", reason="asyncpg (the 'postgres' extra) not installed")

    dsn = sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, TimeoutError) as exc:
        pytest.skip(f"PostgreSQL server unreachable at {PG_URL}: {exc!r}")
    schema = f"ledger_test_{uuid.uuid4().hex[:12]}"
    await conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield {"url": PG_URL, "schema": schema}
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


@pytest.fixture(params=["sqlite", "postgresql"])
async def ledger_db(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[dict[str, Any]]:
    """Keyword arguments for `LedgerStore.open`: a SQLite file, or a fresh PostgreSQL schema."""
    async with fresh_database(request.param, tmp_path / "ledger.db") as kwargs:
        yield kwargs


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_pair(
    request: pytest.FixtureRequest, tmp_path: Any
) -> AsyncIterator[tuple[LedgerStore, LedgerStore]]:
    """Two fresh, separate ledgers on the same kind of database."""
    async with (
        fresh_database(request.param, tmp_path / "one.db") as one_db,
        fresh_database(request.param, tmp_path / "two.db") as two_db,
    ):
        one = await LedgerStore.open(**one_db)
        try:
            two = await LedgerStore.open(**two_db)
            try:
                yield one, two
            finally:
                await two.close()
        finally:
            await one.close()


@pytest.fixture
async def store(ledger_db: dict[str, Any]) -> AsyncIterator[LedgerStore]:
    ledger = await LedgerStore.open(**ledger_db)
    try:
        yield ledger
    finally:
        await ledger.close()


# ---------------------------------------------------------------- events


def routed(event_id: str, request_id: str, tenant: str) -> RequestRouted:
    return RequestRouted(
        event_id=event_id,
        occurred_at=T0,
        request_id=request_id,
        tenant=tenant,
        mode="disaggregated",
        prefill_worker="p-route",
        decode_worker="d-route",
        candidates=3,
        predicted_load=0.5,
    )


def prefill(
    event_id: str,
    request_id: str,
    tenant: str,
    gpu_type: str,
    gpu_seconds: float,
    *,
    workflow_id: str | None = None,
    prompt_tokens: int = 100,
    cached_tokens: int = 0,
) -> PrefillCompleted:
    return PrefillCompleted(
        event_id=event_id,
        occurred_at=T0 + 1,
        request_id=request_id,
        tenant=tenant,
        workflow_id=workflow_id,
        worker_id=f"prefill-{gpu_type}",
        gpu_type=gpu_type,
        gpu_seconds=gpu_seconds,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        ttft_s=0.2,
    )


def decode(
    event_id: str,
    request_id: str,
    tenant: str,
    gpu_type: str,
    gpu_seconds: float,
    *,
    workflow_id: str | None = None,
    prompt_tokens: int = 100,
    cached_tokens: int = 0,
    completion_tokens: int = 50,
    kv_bytes: int = 0,
) -> DecodeCompleted:
    return DecodeCompleted(
        event_id=event_id,
        occurred_at=T0 + 2,
        request_id=request_id,
        tenant=tenant,
        workflow_id=workflow_id,
        worker_id=f"decode-{gpu_type}",
        gpu_type=gpu_type,
        gpu_seconds=gpu_seconds,
        kv_transfer_bytes=kv_bytes,
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        ),
        finish_reason="stop",
        latency_s=1.5,
    )


def failed(event_id: str, request_id: str, tenant: str, *, workflow_id: str | None = None) -> RequestFailed:
    return RequestFailed(
        event_id=event_id,
        occurred_at=T0 + 3,
        request_id=request_id,
        tenant=tenant,
        workflow_id=workflow_id,
        stage="decode",
        worker_id="decode-a10g",
        message="worker lost",
    )


def script() -> list[LifecycleEvent]:
    """Two completed requests, a duplicate, a failed and a rejected request, a fleet view."""
    r1_decode = decode(
        "e-r1-decode",
        "r1",
        "acme",
        "a10g",
        30.0,
        prompt_tokens=1000,
        cached_tokens=256,
        completion_tokens=200,
        kv_bytes=4_000_000,
    )
    return [
        routed("e-r1-routed", "r1", "acme"),
        prefill("e-r1-prefill", "r1", "acme", "h100", 20.0, prompt_tokens=1000, cached_tokens=256),
        r1_decode,
        r1_decode,  # redelivered
        prefill("e-r2-prefill", "r2", "beta", "h100", 5.0, workflow_id="wf-1", prompt_tokens=40),
        decode(
            "e-r2-decode",
            "r2",
            "beta",
            "h100",
            50.0,
            workflow_id="wf-1",
            prompt_tokens=40,
            completion_tokens=500,
            kv_bytes=123,
        ),
        prefill("e-r3-prefill", "r3", "acme", "a10g", 3.0),
        failed("e-r3-failed", "r3", "acme"),
        RequestRejected(
            event_id="e-r4-rejected",
            occurred_at=T0,
            request_id="r4",
            tenant="beta",
            stage="admission",
            reason="quota",
            message="over quota",
            retry_after_s=1.0,
        ),
        FleetObserved(
            event_id="e-fleet",
            occurred_at=T0,
            pools=[
                PoolView(
                    pool="decode-a10g",
                    role="decode",
                    gpu_type="a10g",
                    replicas=2,
                    desired_replicas=2,
                    queue_depth=0,
                    running=1,
                    kv_utilisation=0.3,
                    reason="steady",
                )
            ],
        ),
    ]


async def record_all(store: LedgerStore, events: Sequence[LifecycleEvent]) -> list[bool]:
    return [await store.record(event, PRICES) for event in events]


async def snapshot(store: LedgerStore) -> dict[str, Any]:
    return {
        "totals": await store.totals(),
        "requests": {r: await store.request(r) for r in ("r1", "r2", "r3", "r4")},
        "tenants": await store.by_tenant(),
        "errors": await store.errors(),
    }


# ---------------------------------------------------------------- tests


async def test_scripted_sequence_costs(store: LedgerStore) -> None:
    outcomes = await record_all(store, script())
    assert outcomes == [True, True, True, False, True, True, True, True, True, True]

    r1_prefill, r1_decode = 20.0 * H100_PER_S, 30.0 * A10G_PER_S
    r2_prefill, r2_decode = 5.0 * H100_PER_S, 50.0 * H100_PER_S
    r3_prefill = 3.0 * A10G_PER_S

    r1 = await store.request("r1")
    assert r1 is not None
    assert r1["status"] == "completed" and r1["tenant"] == "acme"
    assert r1["prefill_cost_usd"] == pytest.approx(r1_prefill)
    assert r1["decode_cost_usd"] == pytest.approx(r1_decode)  # counted once despite redelivery
    assert r1["cost_usd"] == pytest.approx(r1_prefill + r1_decode)
    assert r1["prefill_gpu_seconds"] == pytest.approx(20.0)
    assert r1["decode_gpu_seconds"] == pytest.approx(30.0)
    assert (r1["prompt_tokens"], r1["cached_tokens"], r1["completion_tokens"]) == (1000, 256, 200)
    assert r1["kv_transfer_bytes"] == 4_000_000
    # The workers that reported completion win over the routing decision.
    assert (r1["prefill_worker"], r1["decode_worker"]) == ("prefill-h100", "decode-a10g")
    assert (r1["gpu_type_prefill"], r1["gpu_type_decode"]) == ("h100", "a10g")
    assert r1["finish_reason"] == "stop" and r1["latency_s"] == pytest.approx(1.5)

    r2 = await store.request("r2")
    assert r2 is not None
    assert r2["workflow_id"] == "wf-1" and r2["status"] == "completed"
    assert r2["cost_usd"] == pytest.approx(r2_prefill + r2_decode)
    assert (r2["prompt_tokens"], r2["completion_tokens"]) == (40, 500)

    r3 = await store.request("r3")
    assert r3 is not None
    assert r3["status"] == "failed"
    assert r3["prefill_cost_usd"] == pytest.approx(r3_prefill)
    assert r3["decode_cost_usd"] == 0.0

    r4 = await store.request("r4")
    assert r4 is not None
    assert r4["status"] == "rejected" and r4["cost_usd"] == 0.0 and r4["gpu_seconds"] == 0.0

    assert await store.request("nope") is None

    totals = await store.totals()
    assert totals["requests"] == {"running": 0, "completed": 2, "failed": 1, "rejected": 1}
    assert totals["requests_total"] == 4
    assert totals["prefill_spend_usd"] == pytest.approx(r1_prefill + r2_prefill + r3_prefill)
    assert totals["decode_spend_usd"] == pytest.approx(r1_decode + r2_decode)
    assert totals["spend_usd"] == pytest.approx(r1_prefill + r1_decode + r2_prefill + r2_decode + r3_prefill)
    assert totals["prefill_gpu_seconds"] == pytest.approx(28.0)
    assert totals["decode_gpu_seconds"] == pytest.approx(80.0)
    assert totals["gpu_seconds"] == pytest.approx(108.0)
    assert totals["prompt_tokens"] == 1000 + 40 + 100
    assert totals["completion_tokens"] == 200 + 500
    assert totals["kv_transfer_bytes"] == 4_000_123
    assert totals["events"] == 9  # ten deliveries, one duplicate
    assert totals["errors"] == 0

    tenants = {t["tenant"]: t for t in await store.by_tenant()}
    assert set(tenants) == {"acme", "beta"}
    assert tenants["acme"]["spend_usd"] == pytest.approx(r1_prefill + r1_decode + r3_prefill)
    assert (
        tenants["acme"]["requests"],
        tenants["acme"]["completed"],
        tenants["acme"]["failed"],
    ) == (2, 1, 1)
    assert tenants["beta"]["spend_usd"] == pytest.approx(r2_prefill + r2_decode)
    assert (
        tenants["beta"]["requests"],
        tenants["beta"]["completed"],
        tenants["beta"]["rejected"],
    ) == (2, 1, 1)
    assert await store.errors() == []


async def test_route_decisions_are_recorded_without_cost(store: LedgerStore) -> None:
    """The router's reasoning is in the audit trail; it neither prices nor changes a request."""
    option = RouteOption(
        mode="aggregated",
        prefill_worker="decode-h100",
        decode_worker="decode-h100",
        cached_tokens=64,
        ttft_s=0.1,
        cost_usd=0.002,
        success_probability=0.9,
        expected_cost_per_success_usd=0.0022,
    )
    placed = RouteDecision(
        event_id="e-r1-decision",
        occurred_at=T0,
        request_id="r1",
        tenant="acme",
        router="router-1",
        policy="ripplemesh",
        outcome="placed",
        chosen=option,
        runners_up=[option],
        candidates=2,
    )
    refused = RouteDecision(
        event_id="e-r9-decision",
        occurred_at=T0,
        request_id="r9",
        tenant="acme",
        router="router-1",
        policy="ripplemesh",
        outcome="infeasible",
        message="no placement meets the deadline",
    )
    assert await record_all(store, [placed, refused, placed]) == [True, True, False]
    assert await store.request("r9") is None  # the RequestRejected, not the decision, makes the row
    await record_all(store, script())
    totals = await store.totals()
    assert totals["events"] == 9 + 2 and totals["requests_total"] == 4
    r1 = await store.request("r1")
    assert r1 is not None and r1["status"] == "completed"
    assert r1["cost_usd"] == pytest.approx(20.0 * H100_PER_S + 30.0 * A10G_PER_S)


async def test_rerecording_changes_nothing(store: LedgerStore) -> None:
    events = script()
    await record_all(store, events)
    before = await snapshot(store)
    assert await record_all(store, events) == [False] * len(events)
    assert await snapshot(store) == before


async def test_unknown_gpu_type_is_an_error_not_free(store: LedgerStore) -> None:
    unpriced = decode("e-r5-decode", "r5", "acme", "mi300x", 12.0, completion_tokens=9)
    assert await store.record(prefill("e-r5-prefill", "r5", "acme", "h100", 6.0), PRICES)
    assert await store.record(unpriced, PRICES)
    # A redelivery of the unpriced event is still a duplicate: one error, not two.
    assert not await store.record(unpriced, PRICES)

    errors = await store.errors()
    assert len(errors) == 1
    assert errors[0]["event_id"] == "e-r5-decode" and errors[0]["request_id"] == "r5"
    assert "mi300x" in errors[0]["reason"] and "no price" in errors[0]["reason"]

    r5 = await store.request("r5")
    assert r5 is not None
    assert r5["decode_cost_usd"] == 0.0
    assert r5["cost_usd"] == pytest.approx(6.0 * H100_PER_S)
    assert r5["status"] == "completed" and r5["completion_tokens"] == 9
    totals = await store.totals()
    assert totals["errors"] == 1
    assert totals["spend_usd"] == pytest.approx(6.0 * H100_PER_S)


async def test_out_of_order_events(store: LedgerStore) -> None:
    """A decode reported before its prefill, and a late failure after completion."""
    assert await store.record(decode("d", "r6", "acme", "a10g", 10.0), PRICES)
    assert await store.record(prefill("p", "r6", "acme", "h100", 2.0), PRICES)
    assert await store.record(
        RequestFailed(
            event_id="f",
            occurred_at=T0,
            request_id="r6",
            tenant="acme",
            stage="decode",
            message="late report",
        ),
        PRICES,
    )
    assert await store.record(routed("r", "r6", "acme"), PRICES)
    r6 = await store.request("r6")
    assert r6 is not None
    assert r6["status"] == "completed"
    assert r6["cost_usd"] == pytest.approx(10.0 * A10G_PER_S + 2.0 * H100_PER_S)
    assert (r6["prefill_worker"], r6["decode_worker"]) == ("prefill-h100", "decode-a10g")


async def test_migrations_are_idempotent(ledger_db: dict[str, Any]) -> None:
    latest = MIGRATIONS[-1][0]
    first = await LedgerStore.open(**ledger_db)
    try:
        assert await first.schema_version() == latest
        assert await first.record(prefill("e1", "r1", "acme", "h100", 1.0), PRICES)
        assert await first.migrate() == []
    finally:
        await first.close()
    second = await LedgerStore.open(**ledger_db)
    try:
        assert await second.schema_version() == latest
        assert await second.migrate() == []
        r1 = await second.request("r1")
        assert r1 is not None and r1["prefill_cost_usd"] == pytest.approx(H100_PER_S)
        assert not await second.record(prefill("e1", "r1", "acme", "h100", 1.0), PRICES)
    finally:
        await second.close()


def test_pricing() -> None:
    assert price_gpu_seconds("h100", 3600.0, PRICES) == pytest.approx(3.60)
    assert price_gpu_seconds("a10g", 0.0, PRICES) == 0.0
    with pytest.raises(PricingError, match="no price for GPU type 'tpu'"):
        price_gpu_seconds("tpu", 1.0, PRICES)
    with pytest.raises(PricingError, match="invalid GPU time"):
        price_gpu_seconds("h100", -1.0, PRICES)
    assert issubclass(PricingError, ValueError)


# ---------------------------------------------------------------- batches: same as one at a time

# Prices and GPU-seconds (multiples of 225 s, 1/16 h) whose costs and sums are exact in binary
# floating point: a batch must give bit for bit the rows that events one at a time give.
EXACT_PRICES = {"h100": 4.0, "a10g": 2.0}
GPU_TYPES = ("h100", "a10g", "mi300x")  # mi300x has no price: a ledger error


def rejected(event_id: str, request_id: str, tenant: str) -> RequestRejected:
    return RequestRejected(
        event_id=event_id,
        occurred_at=T0,
        request_id=request_id,
        tenant=tenant,
        stage="router",
        reason="no_workers",
        message="no decode worker",
    )


def fleet(event_id: str) -> FleetObserved:
    return FleetObserved(event_id=event_id, occurred_at=T0, pools=[])


async def ledger_state(store: LedgerStore, request_ids: Sequence[str]) -> dict[str, Any]:
    """Everything a ledger holds but the times at which it recorded it: every event and request
    row, the totals, tenants and errors, and `request` of each of `request_ids`."""
    events, rows = store_module.events, store_module.request_costs
    async with store.engine.connect() as conn:
        recorded = await conn.execute(
            sa.select(*(c for c in events.c if c.name != "recorded_at")).order_by(events.c.event_id)
        )
        costs = await conn.execute(
            sa.select(*(c for c in rows.c if c.name != "updated_at")).order_by(rows.c.request_id)
        )
        tables = {"events": [tuple(row) for row in recorded], "request_costs": [tuple(row) for row in costs]}
    requests = {}
    for request_id in request_ids:
        row = await store.request(request_id)
        requests[request_id] = None if row is None else {k: v for k, v in row.items() if k != "updated_at"}
    return {
        **tables,
        "totals": await store.totals(),
        "requests": requests,
        "tenants": await store.by_tenant(),
        "errors": [{k: v for k, v in error.items() if k != "occurred_at"} for error in await store.errors()],
    }


def request_ids_of(events: Sequence[LifecycleEvent]) -> list[str]:
    return sorted({e.request_id for e in events if not isinstance(e, FleetObserved)})


async def test_batches_record_the_same_as_one_at_a_time(store_pair: tuple[LedgerStore, LedgerStore]) -> None:
    """Every event type, duplicates in a batch and of earlier batches, decodes before prefills,
    retried steps and late reports: batches give exactly the rows events one at a time give."""
    one_by_one, batched = store_pair
    q1_prefill = prefill("b-q1-prefill", "q1", "acme", "h100", 450.0, prompt_tokens=300, cached_tokens=16)
    q1_decode = decode("b-q1-decode", "q1", "acme", "a10g", 900.0, prompt_tokens=300, completion_tokens=40)
    fleet_view = fleet("b-fleet")
    first = [
        routed("b-q1-routed", "q1", "acme"),
        q1_prefill,
        q1_prefill,  # redelivered within the batch
        q1_decode,
        # q2: the decode's report before the prefill's; the workflow known from the decode only.
        decode("b-q2-decode", "q2", "beta", "h100", 225.0, workflow_id="wf-2", prompt_tokens=70, kv_bytes=5),
        prefill("b-q2-prefill", "q2", "beta", "a10g", 675.0, prompt_tokens=64, cached_tokens=32),
        routed("b-q2-routed", "q2", "beta"),  # late routing fills nothing
        # q3: prefill then failure; rejected in the next batch.
        prefill("b-q3-prefill", "q3", "acme", "a10g", 225.0, workflow_id="wf-3"),
        failed("b-q3-failed", "q3", "acme", workflow_id="wf-other"),
        rejected("b-q4-rejected", "q4", "beta"),
        # q5: GPU time on an unpriced GPU type (a ledger error), then routing fills the decode worker.
        prefill("b-q5-prefill", "q5", "beta", "mi300x", 450.0),
        routed("b-q5-routed", "q5", "beta"),
        fleet_view,
        routed("b-q6-routed", "q6", "gamma"),
    ]
    second = [
        q1_decode,  # redelivered from the first batch
        fleet_view,
        q1_prefill,
        # q6: a retried prefill (two reports add up on the existing row), then the decode.
        prefill("b-q6-prefill-1", "q6", "gamma", "h100", 225.0, prompt_tokens=10),
        prefill("b-q6-prefill-2", "q6", "gamma", "a10g", 450.0, workflow_id="wf-6", prompt_tokens=12),
        decode("b-q6-decode", "q6", "gamma", "mi300x", 1800.0, completion_tokens=7, kv_bytes=1 << 33),
        decode("b-q6-decode", "q6", "gamma", "mi300x", 1800.0, completion_tokens=7, kv_bytes=1 << 33),
        rejected("b-q3-rejected", "q3", "acme"),
        failed("b-q2-failed", "q2", "beta"),  # a completed request stays completed
        routed("b-q1-routed-again", "q1", "acme"),
        # q7: new in this batch: completed, then a late failure, then its prefill.
        decode("b-q7-decode", "q7", "acme", "a10g", 225.0, workflow_id="wf-7"),
        failed("b-q7-failed", "q7", "acme"),
        prefill("b-q7-prefill", "q7", "acme", "h100", 225.0, prompt_tokens=5),
        # q4: rejected, then routed and prefilled after all.
        routed("b-q4-routed", "q4", "beta"),
        prefill("b-q4-prefill", "q4", "beta", "h100", 225.0),
    ]
    third = [q1_decode, fleet_view, second[3], second[-1]]  # nothing new
    batches = [first, second, third]

    expected = [await one_by_one.record(event, EXACT_PRICES) for batch in batches for event in batch]
    flags = [flag for batch in batches for flag in await batched.record_many(batch, EXACT_PRICES)]
    assert flags == expected
    assert flags.count(False) == 1 + 4 + len(third)

    everything = [event for batch in batches for event in batch]
    state = await ledger_state(batched, request_ids_of(everything))
    assert state == await ledger_state(one_by_one, request_ids_of(everything))

    requests = state["requests"]
    assert {r: requests[r]["status"] for r in requests} == {
        "q1": "completed",
        "q2": "completed",
        "q3": "rejected",
        "q4": "rejected",
        "q5": "running",
        "q6": "completed",
        "q7": "completed",
    }
    assert requests["q2"]["workflow_id"] == "wf-2" and requests["q3"]["workflow_id"] == "wf-3"
    assert (requests["q2"]["prompt_tokens"], requests["q2"]["cached_tokens"]) == (64, 32)
    assert (requests["q5"]["prefill_worker"], requests["q5"]["decode_worker"]) == (
        "prefill-mi300x",
        "d-route",
    )
    assert requests["q6"]["prefill_gpu_seconds"] == 675.0
    assert requests["q6"]["prefill_cost_usd"] == 225.0 / 3600 * 4.0 + 450.0 / 3600 * 2.0
    assert requests["q6"]["gpu_type_prefill"] == "a10g" and requests["q6"]["kv_transfer_bytes"] == 1 << 33
    assert state["totals"]["errors"] == 2 and state["totals"]["events"] == len(
        {e.event_id for e in everything}
    )


def random_events(rng: random.Random, prefix: str) -> list[LifecycleEvent]:
    """Events of every type about a few requests, in any order, with redeliveries."""
    requests = [f"{prefix}-r{i}" for i in range(4)]
    events: list[LifecycleEvent] = []
    for n in range(rng.randrange(1, 30)):
        if events and rng.random() < 0.2:
            events.append(rng.choice(events))
            continue
        event_id, request_id, tenant = f"{prefix}-e{n}", rng.choice(requests), rng.choice(("acme", "beta"))
        workflow_id = rng.choice((None, None, "wf-a", "wf-b"))
        gpu_type, gpu_seconds = rng.choice(GPU_TYPES), 225.0 * rng.randrange(0, 9)
        tokens = {"prompt_tokens": rng.randrange(0, 500), "cached_tokens": rng.randrange(0, 64)}
        kind = rng.randrange(6)
        if kind == 0:
            events.append(routed(event_id, request_id, tenant))
        elif kind == 1:
            events.append(
                prefill(
                    event_id, request_id, tenant, gpu_type, gpu_seconds, workflow_id=workflow_id, **tokens
                )
            )
        elif kind == 2:
            events.append(
                decode(
                    event_id,
                    request_id,
                    tenant,
                    gpu_type,
                    gpu_seconds,
                    workflow_id=workflow_id,
                    completion_tokens=rng.randrange(0, 900),
                    kv_bytes=rng.randrange(0, 1 << 40),
                    **tokens,
                )
            )
        elif kind == 3:
            events.append(failed(event_id, request_id, tenant, workflow_id=workflow_id))
        elif kind == 4:
            events.append(rejected(event_id, request_id, tenant))
        else:
            events.append(fleet(event_id))
    return events


def random_batches(rng: random.Random, events: list[LifecycleEvent]) -> list[list[LifecycleEvent]]:
    cuts = sorted(rng.sample(range(1, len(events)), k=rng.randrange(0, min(4, len(events) - 1) + 1)))
    bounds = [0, *cuts, len(events)]
    return [events[a:b] for a, b in itertools.pairwise(bounds)]


async def test_random_batches_record_the_same_as_one_at_a_time(
    store_pair: tuple[LedgerStore, LedgerStore],
) -> None:
    one_by_one, batched = store_pair
    seen: list[LifecycleEvent] = []
    for seed in range(40):
        rng = random.Random(seed)
        events = random_events(rng, f"s{seed}")
        # Some redeliveries of earlier seeds' events too.
        events += rng.sample(seen, k=min(len(seen), rng.randrange(0, 3)))
        rng.shuffle(events)
        seen += events
        expected = [await one_by_one.record(event, EXACT_PRICES) for event in events]
        flags: list[bool] = []
        for batch in random_batches(rng, events):
            flags += await batched.record_many(batch, EXACT_PRICES)
        assert flags == expected, f"seed {seed}"
        ids = request_ids_of(events)
        assert await ledger_state(batched, ids) == await ledger_state(one_by_one, ids), f"seed {seed}"


async def test_a_batch_costs_a_constant_number_of_statements(store: LedgerStore) -> None:
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if any(table in statement for table in ("events", "request_costs", "ledger_errors")):
            statements.append(" ".join(statement.split("(")[0].split()))

    sa.event.listen(store.engine.sync_engine, "before_cursor_execute", count)
    try:
        for size in (3, 30, 300):
            statements.clear()
            batch: list[LifecycleEvent] = []
            for i in range(size // 3):
                request_id = f"n{size}-{i}"
                batch += [
                    routed(f"{request_id}-r", request_id, "acme"),
                    prefill(f"{request_id}-p", request_id, "acme", "h100", 1.0),
                    decode(f"{request_id}-d", request_id, "acme", "mi300x", 2.0),  # a ledger error
                ]
            flags = await store.record_many(batch + batch[:5], PRICES)
            assert flags == [True] * len(batch) + [False] * len(batch[:5])
            assert statements == [
                "SELECT events.event_id FROM events WHERE events.event_id IN",
                "INSERT INTO events",
                "INSERT INTO request_costs",
                "INSERT INTO ledger_errors",
            ], size
    finally:
        sa.event.remove(store.engine.sync_engine, "before_cursor_execute", count)
    totals = await store.totals()
    assert totals["events"] == 333 and totals["requests"]["completed"] == 111 and totals["errors"] == 111


async def test_drivers_with_named_parameters(
    store_pair: tuple[LedgerStore, LedgerStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where rows cannot go to the driver as tuples, SQLAlchemy's own executemany does the same."""
    direct, other = store_pair
    monkeypatch.setattr(store_module, "_driver_parameter_order", lambda compiled: None)
    through_sqlalchemy = LedgerStore(other.engine)  # compiles its statements with the patch
    rng = random.Random(1)
    events = script() + random_events(rng, "named") + script()
    for ledger in (direct, through_sqlalchemy):
        for batch in random_batches(random.Random(2), events):
            await ledger.record_many(batch, PRICES)
    ids = request_ids_of(events)
    assert await ledger_state(through_sqlalchemy, ids) == await ledger_state(direct, ids)
