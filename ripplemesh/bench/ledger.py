"""`ripplemesh bench ledger`: how many lifecycle events per second the ledger's store records.

A realistic stream (per request: RequestRouted, PrefillCompleted, DecodeCompleted, interleaved across
requests in flight, some decodes reported before their prefill, some redeliveries, a few completions
on an unpriced GPU type; 30% of requests are steps of multi-step workflows, some with deadlines,
some failing or rejected) goes through `LedgerStore.record_batch` in batches, as the ledger's group
commit hands them over, on SQLite (a temporary file) and on PostgreSQL (a fresh schema, dropped
afterwards; skipped with the reason when the server cannot be reached).

The timed loop does all of the ledger's database work, not only the inserts: after each batch it
reads back the touched workflows' totals and builds their WORKFLOW_SPEND values (the bus puts are
left out), and every `IDLE_EVERY_BATCHES` batches it records an idle sample of the fleet's
workers. Each backend's events/s is compared with the target: keeping up with 5,000 lifecycle
events/s. The time of one full report (fleet, by tenant, pool and workflow) is shown apart.
"""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
import uvloop
from rich.console import Console
from rich.table import Table

from schemas.events import (
    DecodeCompleted,
    FleetObserved,
    LifecycleEvent,
    PrefillCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
    Usage,
)
from services.ledger.idle import WorkerSample
from services.ledger.store import LedgerStore
from services.ledger.tasks import workflow_spend
from services.ledger.workflow_spend import encode_workflow_spend

TARGET_EVENTS_PER_S = 5_000.0
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"

PRICES = {"h100": 3.60, "a10g": 1.20, "l4": 0.80}
TENANTS = ("acme", "beta", "gamma", "delta", "omega")
REQUESTS_PER_S = 2_000.0  # arrival rate of the synthetic requests: how much they overlap
DUPLICATE_RATE = 0.02  # redeliveries
OUT_OF_ORDER_RATE = 0.05  # decodes reported before their prefill
UNPRICED_RATE = 0.005  # completions on a GPU type without a price (ledger_errors)
WORKFLOW_RATE = 0.3  # requests that are a step of a multi-step workflow
FAILURE_RATE = 0.02  # requests whose decode fails (RequestFailed instead of DecodeCompleted)
REJECTION_RATE = 0.01  # requests rejected before routing
DEADLINE_RATE = 0.2  # requests with a deadline (a few of them missed)
KV_USD_PER_GB = 0.01
TASK_TIMEOUT_S = 600.0
IDLE_EVERY_BATCHES = 20
T0 = 1_700_000_000.0
# The fleet the idle sampler sees: 8 prefill and 16 decode workers, as in the stream.
WORKERS = [
    WorkerSample(
        f"prefill-{i}", f"prefill-{'h100' if i % 2 else 'a10g'}", "h100" if i % 2 else "a10g", T0 - 60
    )
    for i in range(8)
] + [
    WorkerSample(f"decode-{i}", f"decode-{gpu}", gpu, T0 - 60)
    for i, gpu in ((i, "a10g" if i % 2 else "l4") for i in range(16))
]


def lifecycle_stream(events: int, *, seed: int = 7) -> list[LifecycleEvent]:
    """`events` lifecycle events as the ledger's consumer would receive them, in delivery order."""
    rng = random.Random(seed)
    timed: list[tuple[float, int, LifecycleEvent]] = []
    requests = 0
    # Workflows in flight: id -> (steps, next step); a finished one is replaced by a new one.
    workflows: dict[str, tuple[int, int]] = {}
    next_workflow = 0
    while len(timed) < events:
        requests += 1
        request_id = f"req-{requests:08d}"
        tenant = rng.choice(TENANTS)
        arrived = T0 + requests / REQUESTS_PER_S
        workflow_id: str | None = None
        step = steps = None
        if rng.random() < WORKFLOW_RATE:
            if len(workflows) < 64:
                next_workflow += 1
                workflows[f"wf-{next_workflow}"] = (rng.randrange(2, 7), 1)
            workflow_id = rng.choice(sorted(workflows))
            steps, step = workflows[workflow_id]
            if step == steps:
                del workflows[workflow_id]
            else:
                workflows[workflow_id] = (steps, step + 1)
        if rng.random() < REJECTION_RATE:
            rejected = RequestRejected(
                event_id=uuid.UUID(int=rng.getrandbits(128)).hex,
                occurred_at=arrived,
                request_id=request_id,
                tenant=tenant,
                stage="admission",
                reason="quota",
                message="over quota",
                workflow_id=workflow_id,
                workflow_step=step,
                workflow_steps=steps,
            )
            timed.append((arrived, len(timed), rejected))
            continue
        prefill_gpu = "mi300x" if rng.random() < UNPRICED_RATE else rng.choice(("h100", "a10g"))
        decode_gpu = "mi300x" if rng.random() < UNPRICED_RATE else rng.choice(("a10g", "l4"))
        prefill_worker, decode_worker = f"prefill-{rng.randrange(8)}", f"decode-{rng.randrange(16)}"
        prompt = rng.randrange(16, 4096)
        cached = rng.randrange(0, prompt) if rng.random() < 0.4 else 0
        completion = rng.randrange(1, 1024)
        ttft = rng.uniform(0.02, 0.4)
        latency = ttft + completion * rng.uniform(0.005, 0.02)
        deadline = arrived + latency * rng.uniform(0.9, 3.0) if rng.random() < DEADLINE_RATE else None
        if rng.random() < OUT_OF_ORDER_RATE:
            ttft = latency + 0.01  # the prefill's report arrives after the decode's
        routed = RequestRouted(
            event_id=uuid.UUID(int=rng.getrandbits(128)).hex,
            occurred_at=arrived,
            request_id=request_id,
            tenant=tenant,
            mode="disaggregated",
            prefill_worker=prefill_worker,
            decode_worker=decode_worker,
            candidates=rng.randrange(1, 9),
            predicted_load=rng.random(),
        )
        prefill = PrefillCompleted(
            event_id=uuid.UUID(int=rng.getrandbits(128)).hex,
            occurred_at=arrived + ttft,
            request_id=request_id,
            tenant=tenant,
            workflow_id=workflow_id,
            worker_id=prefill_worker,
            gpu_type=prefill_gpu,
            gpu_seconds=ttft * rng.uniform(0.5, 1.0),
            prompt_tokens=prompt,
            cached_tokens=cached,
            ttft_s=ttft,
        )
        end: LifecycleEvent
        if rng.random() < FAILURE_RATE:
            end = RequestFailed(
                event_id=uuid.UUID(int=rng.getrandbits(128)).hex,
                occurred_at=arrived + latency,
                request_id=request_id,
                tenant=tenant,
                workflow_id=workflow_id,
                stage="decode",
                worker_id=decode_worker,
                message="worker lost",
                workflow_step=step,
                workflow_steps=steps,
                deadline_at=deadline,
            )
        else:
            end = DecodeCompleted(
                event_id=uuid.UUID(int=rng.getrandbits(128)).hex,
                occurred_at=arrived + latency,
                request_id=request_id,
                tenant=tenant,
                workflow_id=workflow_id,
                worker_id=decode_worker,
                gpu_type=decode_gpu,
                # The decode step's share of a GPU that decodes a batch of requests at once.
                gpu_seconds=abs(latency - ttft) / rng.randrange(1, 33),
                kv_transfer_bytes=(prompt - cached) * 131_072,
                usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
                finish_reason="stop" if rng.random() < 0.8 else "length",
                latency_s=latency,
                workflow_step=step,
                workflow_steps=steps,
                deadline_at=deadline,
            )
        for event in (routed, prefill, end):
            timed.append((event.occurred_at, len(timed), event))
            if rng.random() < DUPLICATE_RATE:  # redelivered after the ack wait: a little later
                timed.append((event.occurred_at + rng.uniform(0.0, 2.0), len(timed), event))
    timed.sort(key=lambda item: (item[0], item[1]))
    return [event for _, _, event in timed[:events]]


async def _feed(store: LedgerStore, stream: Sequence[LifecycleEvent], batch: int) -> dict[str, float]:
    started, cpu_started = time.perf_counter(), time.process_time()
    recorded = 0
    spend_values = 0
    for n, start in enumerate(range(0, len(stream), batch)):
        chunk = stream[start : start + batch]
        result = await store.record_batch(chunk, PRICES, kv_usd_per_gb=KV_USD_PER_GB)
        recorded += sum(result.flags)
        # What the WORKFLOW_SPEND publisher does after each batch, but the puts.
        now = chunk[-1].occurred_at
        values = [workflow_spend(f, now, TASK_TIMEOUT_S) for f in result.workflows]
        spend_values += len([encode_workflow_spend(value) for value in values])
        if n % IDLE_EVERY_BATCHES == 0:
            await store.record_idle(WORKERS, now, PRICES, window_s=60.0, backfill_s=10.0)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    now = stream[-1].occurred_at
    report_started = time.perf_counter()
    reports = {
        by: await store.report(now=now, task_timeout_s=TASK_TIMEOUT_S, by=by)
        for by in (None, "tenant", "pool", "workflow")
    }
    report_s = time.perf_counter() - report_started
    totals = await store.totals()
    unique = len({event.event_id for event in stream})
    requests = len({event.request_id for event in stream if not isinstance(event, FleetObserved)})
    if recorded != unique or totals["events"] != unique or totals["requests_total"] != requests:
        raise RuntimeError(
            f"ledger bench: recorded {recorded} events ({totals['events']} stored) and "
            f"{totals['requests_total']} requests; expected {unique} and {requests}"
        )
    fleet = reports[None]["fleet"]
    if abs(fleet["busy_spend_usd"] - totals["spend_usd"]) > 1e-9 * max(1.0, totals["spend_usd"]):
        raise RuntimeError(f"ledger bench: report spend {fleet['busy_spend_usd']} != {totals['spend_usd']}")
    return {
        "events_per_s": len(stream) / wall,
        "cpu_us_per_event": cpu / len(stream) * 1e6,
        "wall_s": wall,
        "report_ms": report_s * 1e3,
        "duplicates": float(len(stream) - unique),
        "errors": float(totals["errors"]),
        "tasks": float(fleet["tasks"]["total"]),
        "succeeded": float(fleet["tasks"]["succeeded"]),
        "workflow_spend_values": float(spend_values),
        "cost_per_successful_task_usd": fleet["cost_per_successful_task_usd"] or 0.0,
    }


async def _sqlite(stream: Sequence[LifecycleEvent], batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ripplemesh-ledger-bench-") as tmp:
        store = await LedgerStore.open(f"sqlite+aiosqlite:///{Path(tmp) / 'ledger.db'}")
        try:
            return await _feed(store, stream, batch)
        finally:
            await store.close()


async def _postgresql(stream: Sequence[LifecycleEvent], batch: int, url: str) -> dict[str, float] | str:
    """The PostgreSQL run's figures, or why it was skipped."""
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError:
        return "asyncpg (the 'postgres' extra) is not installed"
    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        return f"PostgreSQL unreachable at {url}: {exc!r}"
    schema = f"ledger_bench_{uuid.uuid4().hex[:12]}"
    await conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        store = await LedgerStore.open(url, schema=schema)
        try:
            return await _feed(store, stream, batch)
        finally:
            await store.close()
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


async def _bench(
    stream: Sequence[LifecycleEvent], batch: int, postgres_url: str
) -> dict[str, dict[str, float] | str]:
    return {
        "sqlite": await _sqlite(stream, batch),
        "postgresql": await _postgresql(stream, batch, postgres_url),
    }


def run_ledger_bench(
    *, events: int, batch: int, postgres_url: str | None, console: Console
) -> dict[str, float]:
    """Record `events` lifecycle events in batches of `batch` on SQLite and PostgreSQL; print and
    return events/s (and CPU per event) per backend, against the 5,000 events/s target."""
    if events < 1 or batch < 1:
        raise ValueError("events and batch must be >= 1")
    stream = lifecycle_stream(events)
    results = uvloop.run(_bench(stream, batch, postgres_url or DEFAULT_POSTGRES_URL))

    table = Table(title=f"Ledger ingestion: {events} lifecycle events, record_many batches of {batch}")
    for column in ("backend", "wall s", "events/s", "CPU µs/event", "vs 5,000/s target", "report ms"):
        table.add_column(column, justify="right")
    rows: dict[str, float] = {"target_events_per_s": TARGET_EVENTS_PER_S}
    skipped: list[str] = []
    for backend, result in results.items():
        if isinstance(result, str):
            table.add_row(backend, "-", "-", "-", "skipped", "-")
            skipped.append(f"{backend} skipped: {result}")
            continue
        ratio = result["events_per_s"] / TARGET_EVENTS_PER_S
        rows[f"{backend}_events_per_s"] = result["events_per_s"]
        rows[f"{backend}_cpu_us_per_event"] = result["cpu_us_per_event"]
        rows[f"{backend}_target_ratio"] = ratio
        table.add_row(
            backend,
            f"{result['wall_s']:.2f}",
            f"{result['events_per_s']:,.0f}",
            f"{result['cpu_us_per_event']:,.0f}",
            f"{ratio:.2f}x",
            f"{result['report_ms']:,.0f}",
        )
    console.print(table)
    first = next((r for r in results.values() if not isinstance(r, str)), None)
    if first is not None:
        console.print(
            f"stream: {int(first['duplicates'])} redeliveries, {int(first['errors'])} unpriced "
            f"completions (ledger_errors), {int(first['tasks'])} tasks ({int(first['succeeded'])} "
            f"succeeded, cost per successful task ${first['cost_per_successful_task_usd']:.6f}), "
            f"{int(first['workflow_spend_values'])} WORKFLOW_SPEND values built; CPU is this "
            "process's (client side, not the PostgreSQL server)"
        )
    for line in skipped:
        console.print(line)
    return rows
