"""The ledger on the reliability events, through the real store (SQLite): a cancelled request
is priced for what it spent and fails its task; a migrated request's GPU time on every worker
counts, its migration recorded against its task."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from schemas.events import (
    DecodeCompleted,
    LifecycleEvent,
    PrefillCompleted,
    RequestCancelled,
    RequestMigrated,
    Usage,
    WorkStopped,
)
from services.ledger.store import LedgerStore, events
from services.ledger.tasks import task_key

PRICES = {"H100": 3.6}
PER_S = 3.6 / 3600
T0 = 1_700_000_000.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LedgerStore]:
    opened = await LedgerStore.open(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}")
    yield opened
    await opened.close()


def prefill(event_id: str, request_id: str, worker: str, seconds: float) -> PrefillCompleted:
    return PrefillCompleted(
        event_id=event_id,
        occurred_at=T0,
        request_id=request_id,
        tenant="acme",
        worker_id=worker,
        gpu_type="H100",
        gpu_seconds=seconds,
        prompt_tokens=40,
        cached_tokens=0,
        ttft_s=0.1,
    )


def migrated(
    event_id: str, request_id: str, from_worker: str, delivered: int, remaining: int
) -> RequestMigrated:
    """The request's first migration, off a lost decode worker after `delivered` tokens."""
    return RequestMigrated(
        event_id=event_id,
        occurred_at=T0 + 2,
        request_id=request_id,
        tenant="acme",
        migration=1,
        reason="worker_lost",
        from_worker=from_worker,
        from_phase="decode",
        resume_seq=delivered,
        delivered_tokens=delivered,
        remaining_tokens=remaining,
    )


async def record(store: LedgerStore, events: list[LifecycleEvent]) -> None:
    result = await store.record_batch(events, PRICES)
    assert all(result.flags)


async def test_a_cancelled_request_is_priced_and_fails_its_task(store: LedgerStore) -> None:
    await record(
        store,
        [
            prefill("p1", "c1", "decode-0", 2.0),
            RequestCancelled(
                event_id="x1",
                occurred_at=T0 + 1,
                request_id="c1",
                tenant="acme",
                reason="client_disconnected",
            ),
            WorkStopped(
                event_id="s1",
                occurred_at=T0 + 1,
                request_id="c1",
                tenant="acme",
                worker_id="decode-0",
                gpu_type="H100",
                gpu_seconds=10.0,
                tokens_generated=300,
                reason="cancelled",
            ),
        ],
    )
    row = await store.request("c1")
    assert row is not None
    assert row["status"] == "failed"
    assert row["prefill_gpu_seconds"] == pytest.approx(2.0)
    assert row["decode_gpu_seconds"] == pytest.approx(10.0)
    assert row["decode_cost_usd"] == pytest.approx(10.0 * PER_S)
    (task,) = await store.tasks([task_key(None, "c1")])
    assert task.failures == 1 and task.completions == 0
    assert task.gpu_cost_usd == pytest.approx(12.0 * PER_S)


async def test_a_migrated_request_counts_every_workers_time_and_completes(store: LedgerStore) -> None:
    await record(
        store,
        [
            prefill("p1", "m1", "prefill-0", 1.0),
            migrated("g1", "m1", from_worker="decode-0", delivered=41, remaining=59),
            prefill("p2", "m1", "prefill-0", 0.5),  # the re-prefill of prompt + delivered tokens
            DecodeCompleted(
                event_id="d1",
                occurred_at=T0 + 5,
                request_id="m1",
                tenant="acme",
                worker_id="decode-1",
                gpu_type="H100",
                gpu_seconds=4.0,
                kv_transfer_bytes=0,
                usage=Usage(prompt_tokens=40, completion_tokens=100),
                finish_reason="length",
                latency_s=5.0,
            ),
        ],
    )
    row = await store.request("m1")
    assert row is not None
    assert row["status"] == "completed" and row["completion_tokens"] == 100
    assert row["prefill_gpu_seconds"] == pytest.approx(1.5)
    assert row["decode_gpu_seconds"] == pytest.approx(4.0)
    (task,) = await store.tasks([task_key(None, "m1")])
    assert task.completions == 1 and task.gpu_cost_usd == pytest.approx(5.5 * PER_S)
    # The migration is on the task's record, with the worker it left.
    async with store.engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.select(events.c.worker_id).where(
                    events.c.task_key == task_key(None, "m1"), events.c.type == "request.migrated.v1"
                )
            )
        ).all()
    assert [row.worker_id for row in rows] == ["decode-0"]
    # Recorded once: a replay of the same migration event (another router replica) is dropped.
    again = await store.record_batch(
        [migrated("g1", "m1", from_worker="decode-0", delivered=41, remaining=59)],
        PRICES,
    )
    assert again.flags == [False]
