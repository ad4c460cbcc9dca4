"""The figures of merit, exactly, on a real SQLite file and a real PostgreSQL (one schema per test).

One scripted day of the fleet: duplicates and redeliveries, a migrated request (two prefills on
two workers), a failed workflow, a successful 3-step workflow with a retried step, a deadline
miss, a rejection, an abandoned workflow, and idle GPU time. Prices, GPU-seconds and KV bytes are
chosen so that every cost and every sum is exact in binary floating point: the figures are
compared with ``==``, and must not change whatever the batching, or a restart in the middle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from rich.console import Console

from schemas.events import (
    DecodeCompleted,
    LifecycleEvent,
    PrefillCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    Usage,
    decode_event,
    encode_event,
)
from services.ledger import store as store_module
from services.ledger.idle import WorkerSample
from services.ledger.report import ReportError, run_report
from services.ledger.store import MIGRATIONS, LedgerStore
from services.ledger.tasks import FAILURE_REASONS, TASK_STATUSES, status_of
from tests.test_ledger_store import fresh_database

PRICES = {"h100": 4.0, "a10g": 2.0}  # US$/GPU-hour: 225 s of an h100 is exactly $0.25
KV_USD_PER_GB = 0.5
TIMEOUT_S = 600.0
WINDOW_S = 3600.0
T = 1_699_999_200.0  # a whole hour (idle windows of an hour start on it)
NOW = T + 3600.0  # when the figures are read: every task has ended

POOLS = {"p0": "prefill-h100", "p1": "prefill-h100", "spare": "prefill-h100", "d0": "decode-a10g"}
GPU = {"p0": "h100", "p1": "h100", "spare": "h100", "d0": "a10g"}


@contextlib.asynccontextmanager
async def opened(kwargs: dict[str, Any]) -> AsyncIterator[LedgerStore]:
    ledger = await LedgerStore.open(**kwargs)
    try:
        yield ledger
    finally:
        await ledger.close()


@pytest.fixture(params=["sqlite", "postgresql"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    async with fresh_database(request.param, tmp_path / "ledger.db") as kwargs:
        yield kwargs


@pytest.fixture(params=["sqlite", "postgresql"])
async def two_databases(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[dict[str, Any], dict[str, Any]]]:
    async with (
        fresh_database(request.param, tmp_path / "one.db") as one,
        fresh_database(request.param, tmp_path / "two.db") as two,
    ):
        yield one, two


# ---------------------------------------------------------------- the script

_ids = itertools.count()


def _eid(name: str) -> str:
    return f"{name}-{next(_ids)}"


def prefill(
    request_id: str, tenant: str, worker: str, seconds: float, at: float, *, workflow: str | None = None
) -> PrefillCompleted:
    return PrefillCompleted(
        event_id=_eid(f"{request_id}-prefill-{worker}"),
        occurred_at=at,
        request_id=request_id,
        tenant=tenant,
        workflow_id=workflow,
        worker_id=worker,
        gpu_type=GPU.get(worker, "mi300x"),
        gpu_seconds=seconds,
        prompt_tokens=100,
        cached_tokens=0,
        ttft_s=0.1,
    )


def decode(
    request_id: str,
    tenant: str,
    worker: str,
    seconds: float,
    at: float,
    *,
    workflow: str | None = None,
    step: int | None = None,
    steps: int | None = None,
    deadline_at: float | None = None,
    kv_bytes: int = 0,
) -> DecodeCompleted:
    return DecodeCompleted(
        event_id=_eid(f"{request_id}-decode"),
        occurred_at=at,
        request_id=request_id,
        tenant=tenant,
        workflow_id=workflow,
        worker_id=worker,
        gpu_type=GPU.get(worker, "mi300x"),
        gpu_seconds=seconds,
        kv_transfer_bytes=kv_bytes,
        usage=Usage(prompt_tokens=100, completion_tokens=20),
        finish_reason="stop",
        latency_s=2.0,
        workflow_step=step,
        workflow_steps=steps,
        deadline_at=deadline_at,
    )


def failed(
    request_id: str,
    tenant: str,
    at: float,
    *,
    workflow: str | None = None,
    step: int | None = None,
    steps: int | None = None,
) -> RequestFailed:
    return RequestFailed(
        event_id=_eid(f"{request_id}-failed"),
        occurred_at=at,
        request_id=request_id,
        tenant=tenant,
        workflow_id=workflow,
        stage="decode",
        worker_id="d0",
        message="worker lost",
        workflow_step=step,
        workflow_steps=steps,
    )


def routed(request_id: str, tenant: str, at: float) -> RequestRouted:
    return RequestRouted(
        event_id=_eid(f"{request_id}-routed"),
        occurred_at=at,
        request_id=request_id,
        tenant=tenant,
        mode="disaggregated",
        prefill_worker="p0",
        decode_worker="d0",
        candidates=2,
        predicted_load=0.1,
    )


def script() -> list[LifecycleEvent]:
    """The fleet's lifecycle events, in delivery order, redeliveries included."""
    s1_decode = decode("s1", "acme", "d0", 900.0, T + 12, kv_bytes=2_000_000_000)  # $0.5 + $1.0 of KV
    bad_failure = failed("bad-2", "beta", T + 450, workflow="wf-bad", step=2, steps=3)
    ok = "wf-ok"
    return [
        # s1: a standalone request, its decode redelivered. $0.5 + $0.5 + $1.0: succeeded.
        routed("s1", "acme", T + 10),
        prefill("s1", "acme", "p0", 450.0, T + 11),
        s1_decode,
        s1_decode,
        # s2: migrated: prefilled on p0, then again on p1. $0.25 + $0.25 + $0.25: succeeded.
        prefill("s2", "beta", "p0", 225.0, T + 13),
        prefill("s2", "beta", "p1", 225.0, T + 14),
        decode("s2", "beta", "d0", 450.0, T + 15),
        # wf-ok: three steps, step 2 failed once and retried under a new request id. $1.75.
        prefill("ok-1", "acme", "p0", 225.0, T + 400, workflow=ok),
        decode("ok-1", "acme", "d0", 450.0, T + 401, workflow=ok, step=1, steps=3),
        prefill("ok-2a", "acme", "p0", 225.0, T + 402, workflow=ok),
        failed("ok-2a", "acme", T + 403, workflow=ok, step=2, steps=3),
        prefill("ok-2b", "acme", "p0", 225.0, T + 404, workflow=ok),
        decode("ok-2b", "acme", "d0", 450.0, T + 405, workflow=ok, step=2, steps=3),
        # The final step's decode reported before its prefill.
        decode("ok-3", "acme", "d0", 450.0, T + 407, workflow=ok, step=3, steps=3, deadline_at=T + 500),
        prefill("ok-3", "acme", "p0", 225.0, T + 406, workflow=ok),
        # wf-bad: step 1 done, step 2 fails and is never retried: failed, $0.75 wasted.
        prefill("bad-1", "beta", "p0", 225.0, T + 420, workflow="wf-bad"),
        decode("bad-1", "beta", "d0", 450.0, T + 421, workflow="wf-bad", step=1, steps=3),
        prefill("bad-2", "beta", "p0", 225.0, T + 430, workflow="wf-bad"),
        bad_failure,
        bad_failure,
        # s3: completed a second after its deadline: failed, $0.5 wasted.
        prefill("s3", "acme", "p0", 225.0, T + 440),
        decode("s3", "acme", "d0", 450.0, T + 461, deadline_at=T + 460),
        # s4: rejected at admission: failed, nothing spent.
        RequestRejected(
            event_id=_eid("s4-rejected"),
            occurred_at=T + 470,
            request_id="s4",
            tenant="beta",
            stage="admission",
            reason="quota",
            message="over quota",
        ),
        # wf-quiet: step 1 of 2, then nothing: abandoned 600 s after T + 501, $0.5 wasted.
        prefill("quiet-1", "acme", "p0", 225.0, T + 500, workflow="wf-quiet"),
        decode("quiet-1", "acme", "d0", 450.0, T + 501, workflow="wf-quiet", step=1, steps=2),
    ]


def samples(*workers: str) -> list[WorkerSample]:
    return [WorkerSample(w, POOLS[w], GPU[w], started_at=T - 100.0) for w in workers]


async def sample_idle(ledger: LedgerStore, at: float, *workers: str) -> None:
    await ledger.record_idle(samples(*workers), at, PRICES, window_s=WINDOW_S, backfill_s=0.0)


# Idle: every worker first seen at T (nothing before counts), before the day's events. From T to
# T + 900 p0 and d0 report more GPU time than 900 s (a debt), spare nothing: $1.0. From T + 900 to
# T + 3600, p0 idles 2700 - (2475 - 900) = 1125 s ($1.25), d0 none (debt 3150 > 2700), spare
# 2700 s ($3.0).
IDLE_SAMPLES = (
    (T, ("p0", "p1", "spare", "d0")),
    (T + 900, ("p0", "spare", "d0")),
    (NOW, ("p0", "spare", "d0")),
)

GPU_SPEND = 5.25
KV_SPEND = 1.0
IDLE_SPEND = 1.0 + 1.25 + 3.0
WASTED = 0.75 + 0.5 + 0.5  # wf-bad, s3, wf-quiet (s4 spent nothing)


def expected_fleet() -> dict[str, Any]:
    spend = GPU_SPEND + KV_SPEND + IDLE_SPEND
    return {
        "cost_per_successful_task_usd": spend / 3,
        "spend_usd": spend,
        "busy_spend_usd": GPU_SPEND + KV_SPEND,
        "gpu_spend_usd": GPU_SPEND,
        "kv_transfer_spend_usd": KV_SPEND,
        "idle_spend_usd": IDLE_SPEND,
        "wasted_spend_usd": WASTED,
        "waste_fraction": WASTED / spend,
        "gpu_seconds": 2475.0 + 225.0 + 4050.0,  # p0, p1, d0
        "idle_gpu_seconds": 900.0 + 1125.0 + 2700.0,
        "provisioned_gpu_seconds": 3 * 3600.0,
        "tasks": {"succeeded": 3, "failed": 4, "running": 0, "total": 7},
        "failed_by_reason": {"step_failed": 2, "deadline_missed": 1, "abandoned": 1},
        "errors": 0,
    }


async def record_script(ledger: LedgerStore, events: Sequence[LifecycleEvent], batch: int) -> list[bool]:
    flags: list[bool] = []
    for start in range(0, len(events), batch):
        flags += await ledger.record_many(events[start : start + batch], PRICES, kv_usd_per_gb=KV_USD_PER_GB)
    return flags


async def run_day(ledger: LedgerStore, events: Sequence[LifecycleEvent], batch: int) -> None:
    """Workers first seen at T, then the day's events, then two more idle samples."""
    (first, first_workers), *later = IDLE_SAMPLES
    await sample_idle(ledger, first, *first_workers)
    await record_script(ledger, events, batch)
    for at, workers in later:
        await sample_idle(ledger, at, *workers)


async def all_reports(ledger: LedgerStore, now: float = NOW) -> dict[str, Any]:
    out = {}
    for since in (None, T + 300):
        for by in (None, "tenant", "pool", "workflow"):
            report = await ledger.report(now=now, task_timeout_s=TIMEOUT_S, since=since, by=by)  # type: ignore[arg-type]
            out[f"{by}-{since}"] = report
    return out


# ---------------------------------------------------------------- exactness


async def test_figures_of_a_scripted_day(database: dict[str, Any]) -> None:
    events = script()
    async with opened(database) as ledger:
        (first, first_workers), *later = IDLE_SAMPLES
        await sample_idle(ledger, first, *first_workers)
        flags = await record_script(ledger, events, batch=1)
        assert flags.count(False) == 2  # the redelivered decode and failure
        for at, workers in later:
            await sample_idle(ledger, at, *workers)

        report = await ledger.report(now=NOW, task_timeout_s=TIMEOUT_S)
        assert report["fleet"] == expected_fleet()
        assert report["since"] is None and report["until"] == NOW and report["groups"] == []

        tenants = {
            g["tenant"]: g
            for g in (await ledger.report(now=NOW, task_timeout_s=TIMEOUT_S, by="tenant"))["groups"]
        }
        acme, beta = tenants["acme"], tenants["beta"]
        # Idle time belongs to no tenant: a tenant's cost per task is its own spend.
        assert (acme["spend_usd"], acme["wasted_spend_usd"], acme["idle_spend_usd"]) == (4.75, 1.0, None)
        assert acme["tasks"] == {"succeeded": 2, "failed": 2, "running": 0, "total": 4}
        assert acme["cost_per_successful_task_usd"] == 4.75 / 2
        assert acme["failed_by_reason"] == {"step_failed": 0, "deadline_missed": 1, "abandoned": 1}
        assert (beta["spend_usd"], beta["wasted_spend_usd"]) == (1.5, 0.75)
        assert beta["tasks"] == {"succeeded": 1, "failed": 2, "running": 0, "total": 3}
        assert beta["cost_per_successful_task_usd"] == 1.5

        pools = {
            g["pool"]: g
            for g in (await ledger.report(now=NOW, task_timeout_s=TIMEOUT_S, by="pool"))["groups"]
        }
        prefill_pool, decode_pool = pools["prefill-h100"], pools["decode-a10g"]
        assert set(pools) == {"prefill-h100", "decode-a10g"}
        assert (prefill_pool["busy_spend_usd"], prefill_pool["idle_spend_usd"]) == (3.0, IDLE_SPEND)
        assert prefill_pool["spend_usd"] == 3.0 + IDLE_SPEND
        assert prefill_pool["wasted_spend_usd"] == 0.25 + 0.25 + 0.25 + 0.25  # wf-bad's two, s3, wf-quiet
        # s4 used no pool: each pool's tasks are those with GPU time on it.
        assert prefill_pool["tasks"] == {"succeeded": 3, "failed": 3, "running": 0, "total": 6}
        assert prefill_pool["cost_per_successful_task_usd"] == (3.0 + IDLE_SPEND) / 3
        assert (decode_pool["gpu_spend_usd"], decode_pool["kv_transfer_spend_usd"]) == (2.25, 1.0)
        assert (decode_pool["idle_spend_usd"], decode_pool["idle_gpu_seconds"]) == (0.0, 0.0)
        assert decode_pool["wasted_spend_usd"] == 0.75
        assert prefill_pool["busy_spend_usd"] + decode_pool["busy_spend_usd"] == GPU_SPEND + KV_SPEND

        workflows = {
            g["workflow"]: g
            for g in (await ledger.report(now=NOW, task_timeout_s=TIMEOUT_S, by="workflow"))["groups"]
        }
        assert [g for g in workflows] == ["wf-quiet", "wf-bad", "wf-ok"]  # latest first
        assert {
            w: (g["status"], g["reason"], g["spend_usd"], g["wasted_spend_usd"]) for w, g in workflows.items()
        } == {
            "wf-ok": ("succeeded", None, 1.75, 0.0),
            "wf-bad": ("failed", "step_failed", 0.75, 0.75),
            "wf-quiet": ("failed", "abandoned", 0.5, 0.5),
        }
        assert (workflows["wf-ok"]["steps_completed"], workflows["wf-ok"]["steps"]) == (3, 3)
        assert (workflows["wf-ok"]["completions"], workflows["wf-ok"]["failures"]) == (3, 1)

        # A window: only what was spent since T + 300, and the tasks that ended since.
        window = (await ledger.report(now=NOW, task_timeout_s=TIMEOUT_S, since=T + 300))["fleet"]
        busy = 1.75 + 0.75 + 0.5 + 0.5  # wf-ok, wf-bad, s3, wf-quiet
        assert (window["busy_spend_usd"], window["idle_spend_usd"]) == (busy, IDLE_SPEND)
        assert window["tasks"] == {"succeeded": 1, "failed": 4, "running": 0, "total": 5}
        assert window["cost_per_successful_task_usd"] == busy + IDLE_SPEND
        assert window["wasted_spend_usd"] == WASTED

        # Earlier, wf-quiet was still running (its timeout had not passed): nothing is final
        # until the clock says so, and the same rows give the later figures.
        before = (await ledger.report(now=T + 1000, task_timeout_s=TIMEOUT_S))["fleet"]
        assert before["tasks"] == {"succeeded": 3, "failed": 3, "running": 1, "total": 7}
        assert before["wasted_spend_usd"] == WASTED - 0.5

        # The request rows carry the KV transfer and the step.
        s1 = await ledger.request("s1")
        assert s1 is not None and s1["kv_cost_usd"] == 1.0 and s1["cost_usd"] == 2.0
        ok3 = await ledger.request("ok-3")
        assert ok3 is not None and (ok3["workflow_step"], ok3["workflow_steps"]) == (3, 3)
        assert ok3["deadline_at"] == T + 500 and ok3["completed_at"] == T + 407
        totals = await ledger.totals()
        assert totals["spend_usd"] == GPU_SPEND + KV_SPEND and totals["kv_transfer_spend_usd"] == KV_SPEND


async def test_batching_and_restarts_give_the_same_figures(
    two_databases: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """One event at a time, uninterrupted, against: random batches, the ledger stopped twice mid
    stream (its last batch lost: redelivered with everything after it), events shuffled."""
    events = script()
    one_db, two_db = two_databases
    async with opened(one_db) as ledger:
        await run_day(ledger, events, batch=1)
        expected = await all_reports(ledger)
    assert expected["None-None"]["fleet"] == expected_fleet()

    rng = random.Random(7)
    shuffled = events[:]
    rng.shuffle(shuffled)
    cut1, cut2 = 9, 17
    (first, first_workers), (second, second_workers), (third, third_workers) = IDLE_SAMPLES
    async with opened(two_db) as ledger:
        await sample_idle(ledger, first, *first_workers)
        await record_script(ledger, shuffled[:cut1], batch=4)
    # Restarted: the stream resumes before the cut (unacked events come back).
    async with opened(two_db) as ledger:
        await record_script(ledger, shuffled[cut1 - 3 : cut2], batch=5)
    async with opened(two_db) as ledger:
        await record_script(ledger, shuffled[cut2 - 6 :] + shuffled[:3], batch=7)
        await sample_idle(ledger, second, *second_workers)
    async with opened(two_db) as ledger:
        await sample_idle(ledger, third, *third_workers)
        assert await all_reports(ledger) == expected


async def test_task_status_sql_matches_the_pure_rules(database: dict[str, Any]) -> None:
    """Random workflows and requests: the report's counts (SQL) are tasks.py's, at any time."""
    rng = random.Random(3)
    events: list[LifecycleEvent] = []
    for _ in range(300):
        workflow = rng.choice((None, f"wf-{rng.randrange(40)}"))
        steps = rng.choice((None, 1, 2, 3)) if workflow else None
        step = rng.choice((None, 1, 2, 3)) if workflow else None
        at = T + rng.randrange(0, 3000)
        request_id, tenant = f"r{rng.randrange(200)}", rng.choice(("acme", "beta"))
        kind = rng.randrange(3)
        if kind == 0:
            deadline = rng.choice((None, at - 1, at + 1))
            events.append(
                decode(
                    request_id,
                    tenant,
                    "d0",
                    225.0,
                    at,
                    workflow=workflow,
                    step=step,
                    steps=steps,
                    deadline_at=deadline,
                )
            )
        elif kind == 1:
            events.append(failed(request_id, tenant, at, workflow=workflow, step=step, steps=steps))
        else:
            events.append(prefill(request_id, tenant, "p0", 225.0, at, workflow=workflow))
    async with opened(database) as ledger:
        await record_script(ledger, events, batch=64)
        async with ledger.engine.connect() as conn:
            keys = list((await conn.execute(sa.select(store_module.tasks.c.task_key))).scalars())
        facts = await ledger.tasks(keys)
        assert len(facts) == len(keys) > 50
        for now in (T, T + 1000, T + 3000, T + 3601, T + 9999):
            expected: dict[str, Any] = {status: 0 for status in TASK_STATUSES}
            reasons = dict.fromkeys(FAILURE_REASONS, 0)
            for f in facts:
                status, reason = status_of(f, now, TIMEOUT_S)
                expected[status] += 1
                if reason is not None:
                    reasons[reason] += 1
            fleet = (await ledger.report(now=now, task_timeout_s=TIMEOUT_S))["fleet"]
            assert {k: fleet["tasks"][k] for k in TASK_STATUSES} == expected, now
            assert fleet["failed_by_reason"] == reasons, now


# ---------------------------------------------------------------- bad input


async def test_bad_input_is_recorded_with_the_reason(database: dict[str, Any]) -> None:
    async with opened(database) as ledger:
        # A decode whose request was never routed nor prefilled: recorded, priced, a task.
        orphan = decode("orphan", "acme", "d0", 450.0, T + 1)
        # Negative GPU time can only come from a producer that skipped validation: decoding
        # rejects it, and the ledger never adds it anywhere.
        negative = msgspec.structs.replace(prefill("neg", "acme", "p0", 1.0, T + 2), gpu_seconds=-5.0)
        with pytest.raises(msgspec.ValidationError, match="gpu_seconds"):
            decode_event(encode_event(negative))
        unpriced = decode("mi", "beta", "mi-0", 900.0, T + 3, kv_bytes=1_000_000_000)
        assert (
            await ledger.record_many([orphan, negative, unpriced], PRICES, kv_usd_per_gb=KV_USD_PER_GB)
            == [True] * 3
        )
        errors = await ledger.errors()
        assert [(e["event_id"], e["request_id"]) for e in errors] == [
            (negative.event_id, "neg"),
            (unpriced.event_id, "mi"),
        ]
        assert "invalid GPU time" in errors[0]["reason"] and "-5.0" in errors[0]["reason"]
        assert "no price for GPU type 'mi300x'" in errors[1]["reason"]
        neg = await ledger.request("neg")
        assert neg is not None and neg["prefill_gpu_seconds"] == 0.0 and neg["cost_usd"] == 0.0
        mi = await ledger.request("mi")
        # The GPU time is unpriced (an error, not $0 silently); the KV transfer is priced.
        assert mi is not None and mi["decode_cost_usd"] == 0.0 and mi["kv_cost_usd"] == 0.5
        report = await ledger.report(now=T + 10, task_timeout_s=TIMEOUT_S)
        assert report["fleet"]["errors"] == 2
        assert report["fleet"]["gpu_spend_usd"] == 0.25 and report["fleet"]["gpu_seconds"] == 450.0 + 900.0
        assert report["fleet"]["tasks"]["succeeded"] == 2  # orphan and mi completed

        # Idle time of a GPU type without a price: an error with the reason, $0 recorded.
        spare = [WorkerSample("mi-0", "decode-mi300x", "mi300x", started_at=T)]
        await ledger.record_idle(spare, T, PRICES, window_s=WINDOW_S, backfill_s=0.0)
        result = await ledger.record_idle(spare, T + 3600, PRICES, window_s=WINDOW_S, backfill_s=0.0)
        assert [e.worker_id for e in result.errors] == ["mi-0"]
        assert "idle time not priced" in result.errors[0].reason and "mi300x" in result.errors[0].reason
        # First seen after its decode was recorded: that GPU time is set against nothing.
        assert result.idle_gpu_seconds == 3600.0 and result.idle_cost_usd == 0.0
        assert len(await ledger.errors()) == 3


# ---------------------------------------------------------------- schema and statements


async def test_migration_2_upgrades_a_version_1_ledger(database: dict[str, Any]) -> None:
    old = script()[:4]
    async with contextlib.AsyncExitStack() as stack:
        v1 = await LedgerStore.open(**database, migrations=MIGRATIONS[:1])
        stack.push_async_callback(v1.close)
        assert await v1.schema_version() == 1
        async with v1._write() as conn:  # a version-1 ledger's own rows
            await conn.execute(
                sa.text(
                    "INSERT INTO events (event_id, type, request_id, tenant, occurred_at, recorded_at) "
                    "VALUES ('old', 'request.routed.v1', 's1', 'acme', 1.0, 1.0)"
                )
            )
    async with opened(database) as ledger:
        assert await ledger.schema_version() == MIGRATIONS[-1][0] >= 2
        flags = await record_script(ledger, old, batch=10)
        assert flags == [True, True, True, False]
        assert (await ledger.totals())["events"] == 4
        assert (await ledger.report(now=NOW, task_timeout_s=TIMEOUT_S))["fleet"]["tasks"]["succeeded"] == 1


async def test_a_batch_is_still_a_constant_number_of_statements(database: dict[str, Any]) -> None:
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        words = " ".join(statement.split("(")[0].split())
        if not words.startswith(("BEGIN", "COMMIT", "SAVEPOINT")):
            statements.append("SELECT tasks" if words.startswith("SELECT tasks.") else words)

    base = [
        "SELECT events.event_id FROM events WHERE events.event_id IN",
        "INSERT INTO events",
        "INSERT INTO request_costs",
        "INSERT INTO tasks",
        "INSERT INTO workers",
    ]
    async with opened(database) as ledger:
        sa.event.listen(ledger.engine.sync_engine, "before_cursor_execute", count)
        unpriced = decode("mi", "beta", "mi-0", 900.0, T + 3)
        for events, expected in (
            (script()[:2] * 2, base),  # no workflow, no error
            (script() * 2, [*base, "SELECT tasks"]),  # the workflows' totals, read back
            (script() * 10 + [unpriced], [*base, "INSERT INTO ledger_errors", "SELECT tasks"]),
        ):
            statements.clear()
            flags = await record_script(ledger, events, batch=1000)
            assert flags.count(True) == len({e.event_id for e in events})
            assert statements == expected, len(events)


# ---------------------------------------------------------------- the report command


async def test_report_prints_from_the_database(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    async with opened({"url": url}) as ledger:
        await run_day(ledger, script(), batch=8)
    console = Console(record=True, width=160)
    for by in (None, "tenant", "pool", "workflow"):
        report = await asyncio.to_thread(
            run_report, database_url=url, by=by, now=NOW, task_timeout_s=TIMEOUT_S, console=console
        )
        assert report["fleet"] == expected_fleet()
    text = console.export_text()
    assert "cost per successful task" in text and "$3.8333" in text
    assert "wf-quiet" in text and "abandoned" in text and "prefill-h100" in text
    window = await asyncio.to_thread(
        run_report, database_url=url, since="3300s", now=NOW, task_timeout_s=TIMEOUT_S, console=console
    )
    assert window["since"] == T + 300
    with pytest.raises(ReportError, match="no ledger database"):
        run_report(database_url=f"sqlite+aiosqlite:///{tmp_path / 'none.db'}", console=console)
    with pytest.raises(ReportError, match="--since"):
        run_report(database_url=url, since="yesterday-ish", console=console)
    with pytest.raises(ReportError, match="--by"):
        run_report(database_url=url, by="region", console=console)
    assert not math.isnan(window["fleet"]["spend_usd"])


# ---------------------------------------------------------------- HTTP and Prometheus


async def test_report_over_http_and_as_gauges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    from prometheus_client import REGISTRY
    from starlette.applications import Starlette

    from services.ledger import service as service_module

    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    async with opened({"url": url}) as ledger:
        await run_day(ledger, script(), batch=8)
        service = service_module.LedgerService()
        service.store, service.task_timeout_s = ledger, TIMEOUT_S
        monkeypatch.setattr(service_module.time, "time", lambda: NOW)
        app = Starlette(routes=service.routes())
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://ledger"
        ) as http:
            report = (await http.get("/v1/ledger/report")).json()
            assert report["fleet"] == expected_fleet()
            pools = (await http.get("/v1/ledger/report", params={"by": "pool", "since": "1h"})).json()
            assert pools["since"] == T and {g["pool"] for g in pools["groups"]} == {
                "prefill-h100",
                "decode-a10g",
            }
            workflows = (await http.get("/v1/ledger/report?by=workflow&limit=2")).json()["groups"]
            assert [g["workflow"] for g in workflows] == ["wf-quiet", "wf-bad"]
            quiet = (await http.get("/v1/ledger/workflows/wf-quiet")).json()
            assert (quiet["status"], quiet["reason"], quiet["spend_usd"]) == ("failed", "abandoned", 0.5)
            assert (await http.get("/v1/ledger/workflows/nope")).status_code == 404
            for bad in ({"by": "region"}, {"since": "someday"}, {"limit": "many"}):
                response = await http.get("/v1/ledger/report", params=bad)
                assert response.status_code == 400 and "error" in response.json()
            # No task succeeded in this window: no cost per task (null, never NaN in JSON).
            empty = (await http.get("/v1/ledger/report", params={"since": str(NOW)})).json()["fleet"]
            assert empty["cost_per_successful_task_usd"] is None and empty["tasks"]["total"] == 0

        # The gauges: the same figures over the trailing hour (NOW - 3600 = T).
        service.FIGURES_WINDOW_S = 3600.0  # type: ignore[misc]
        await service.refresh_figures()

        def gauge(name: str, **labels: str) -> float | None:
            return REGISTRY.get_sample_value(name, {"window": "1h", **labels})

        assert (
            gauge("ripplemesh_ledger_cost_per_successful_task_usd")
            == expected_fleet()["cost_per_successful_task_usd"]
        )
        assert gauge("ripplemesh_ledger_window_spend_usd", kind="wasted") == WASTED
        assert gauge("ripplemesh_ledger_window_spend_usd", kind="idle") == IDLE_SPEND
        assert gauge("ripplemesh_ledger_window_tasks", status="succeeded") == 3
        assert gauge("ripplemesh_ledger_window_failed_tasks", reason="abandoned") == 1
        assert gauge("ripplemesh_ledger_tenant_window_spend_usd", tenant="acme", kind="total") == 4.75
        assert gauge("ripplemesh_ledger_tenant_cost_per_successful_task_usd", tenant="beta") == 1.5
        assert (
            gauge("ripplemesh_ledger_pool_window_spend_usd", pool="prefill-h100", kind="idle") == IDLE_SPEND
        )
        assert gauge("ripplemesh_ledger_pool_window_spend_usd", pool="decode-a10g", kind="busy") == 3.25
