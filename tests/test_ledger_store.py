"""LedgerStore against a real SQLite file and a real PostgreSQL (one fresh schema per test)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from schemas.events import (
    DecodeCompleted,
    FleetObserved,
    LifecycleEvent,
    PoolView,
    PrefillCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    Usage,
)
from services.ledger.pricing import PricingError, price_gpu_seconds
from services.ledger.store import MIGRATIONS, LedgerStore

PG_URL = os.environ.get("RIPPLEMESH_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")

PRICES = {"h100": 3.60, "a10g": 1.20}
H100_PER_S = 3.60 / 3600
A10G_PER_S = 1.20 / 3600

T0 = 1_700_000_000.0


# ---------------------------------------------------------------- fixtures


@pytest.fixture(params=["sqlite", "postgresql"])
async def ledger_db(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[dict[str, Any]]:
    """Keyword arguments for `LedgerStore.open`: a SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield {"url": f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"}
        return
    import sqlalchemy as sa

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
        RequestFailed(
            event_id="e-r3-failed",
            occurred_at=T0 + 3,
            request_id="r3",
            tenant="acme",
            stage="decode",
            worker_id="decode-a10g",
            message="worker lost",
        ),
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
