"""Ledger service: consume every lifecycle event, record its cost (store.py), serve the figures.

Database: ``--database-url`` (SQLite or PostgreSQL, see store.py), else ``<data_dir>/ledger.db``.
Prices: the mesh config's ``gpu_prices_per_hour`` (US$ per GPU-hour, by GPU type) and
``kv_transfer_usd_per_gb``; tasks are abandoned after the config's ``task_timeout_s``.

Besides recording events (group commit), the service runs:

- the idle sampler: every `IDLE_SAMPLE_S` it reads the WORKERS bucket and records each live
  worker's idle GPU time (idle.py, `LedgerStore.record_idle`);
- the WORKFLOW_SPEND bucket: every committed batch's workflows are put with their running spend,
  and a sweep puts the workflows abandoned since (workflow_spend.py);
- the figures as Prometheus gauges over the last `FIGURES_WINDOW_S`, refreshed every
  `FIGURES_EVERY_S` from the database (so they survive restarts and agree with the report).

HTTP: ``GET /v1/ledger/totals``, ``GET /v1/ledger/requests/{request_id}``,
``GET /v1/ledger/tenants``, ``GET /v1/ledger/report?by=tenant|pool|workflow&since=...&limit=...``
(the figures of merit, figures.py; `since` is a duration back from now such as ``1h``, an ISO 8601
time or Unix seconds) and ``GET /v1/ledger/workflows/{workflow_id}`` (its spend and status).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

import msgspec
from nats.js.errors import KeyNotFoundError
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from schemas.events import DecodeCompleted, LifecycleEvent, PrefillCompleted, WorkerState
from schemas.subjects import LEDGER_CONSUMER, WORKERS, WORKFLOW_SPEND
from services.ledger.figures import Figures, SinceError, parse_since
from services.ledger.idle import WorkerSample
from services.ledger.pricing import PricingError, price_gpu_seconds, price_kv_transfer
from services.ledger.store import DIMENSIONS, BatchResult, LedgerStore, default_database_url
from services.ledger.tasks import status_of, workflow_key
from services.ledger.workflow_spend import WorkflowSpendPublisher
from services.mesh.bus import kv_keys
from services.mesh.consumer import Delivery
from services.mesh.runtime import Runtime

log = logging.getLogger(__name__)

COST_USD = "ripple.cost_usd"

EVENTS = Counter(
    "ripplemesh_ledger_events_total",
    "Lifecycle events seen by the ledger, by type and outcome (recorded, duplicate).",
    ["type", "outcome"],
)
ERRORS = Counter(
    "ripplemesh_ledger_errors_total",
    "Events whose GPU time could not be priced (kept in ledger_errors), by type.",
    ["type"],
)


class _PendingCosts:
    """Request id -> its prefill's cost until its decode reports (the oldest forgotten past
    `capacity`: a request whose decode never reports)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._costs: OrderedDict[str, float] = OrderedDict()

    def put(self, request_id: str, cost: float) -> None:
        self._costs[request_id] = self._costs.get(request_id, 0.0) + cost
        while len(self._costs) > self.capacity:
            self._costs.popitem(last=False)

    def pop(self, request_id: str) -> float:
        return self._costs.pop(request_id, 0.0)


REQUEST_COST = Histogram(
    "ripplemesh_ledger_request_cost_usd",
    "A completed request's cost (prefill, decode, KV hand-off), by tenant and class.",
    ["tenant", "priority"],
    buckets=(1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
)
SPEND = Counter(
    "ripplemesh_ledger_spend_usd_total",
    "Spend recorded by the ledger, in US$, by tenant and phase (prefill, decode, kv_transfer).",
    ["tenant", "phase"],
)
IDLE_SPEND = Counter(
    "ripplemesh_ledger_idle_spend_usd_total",
    "Provisioned but idle GPU time recorded by the ledger, in US$, by pool.",
    ["pool"],
)
IDLE_GPU_SECONDS = Counter(
    "ripplemesh_ledger_idle_gpu_seconds_total",
    "Provisioned but idle GPU-seconds recorded by the ledger, by pool.",
    ["pool"],
)
# The figures of merit over a trailing window, from the database (see LedgerService.refresh_figures).
COST_PER_TASK = Gauge(
    "ripplemesh_ledger_cost_per_successful_task_usd",
    "All spend (failed tasks' and idle included) over the tasks that succeeded, over the trailing "
    "window; NaN while none succeeded.",
    ["window"],
)
WINDOW_SPEND = Gauge(
    "ripplemesh_ledger_window_spend_usd",
    "Spend over the trailing window, in US$, by kind: total, gpu, kv_transfer, idle, wasted "
    "(spend on failed tasks).",
    ["window", "kind"],
)
WINDOW_TASKS = Gauge(
    "ripplemesh_ledger_window_tasks",
    "Tasks whose last event is in the trailing window, by status (succeeded, failed, running).",
    ["window", "status"],
)
WINDOW_FAILED = Gauge(
    "ripplemesh_ledger_window_failed_tasks",
    "Failed tasks in the trailing window, by reason (step_failed, deadline_missed, abandoned).",
    ["window", "reason"],
)
TENANT_SPEND = Gauge(
    "ripplemesh_ledger_tenant_window_spend_usd",
    "A tenant's spend over the trailing window, in US$, by kind: total (GPU and KV transfer; idle "
    "is not attributed to tenants), wasted.",
    ["window", "tenant", "kind"],
)
TENANT_COST_PER_TASK = Gauge(
    "ripplemesh_ledger_tenant_cost_per_successful_task_usd",
    "A tenant's spend over its tasks that succeeded, over the trailing window.",
    ["window", "tenant"],
)
TENANT_TASKS = Gauge(
    "ripplemesh_ledger_tenant_window_tasks",
    "A tenant's tasks in the trailing window, by status.",
    ["window", "tenant", "status"],
)
POOL_SPEND = Gauge(
    "ripplemesh_ledger_pool_window_spend_usd",
    "A pool's spend over the trailing window, in US$, by kind: total, busy (GPU and KV transfer), "
    "idle, wasted.",
    ["window", "pool", "kind"],
)
POOL_COST_PER_TASK = Gauge(
    "ripplemesh_ledger_pool_cost_per_successful_task_usd",
    "A pool's spend (idle included) over the successful tasks that used it, over the trailing window.",
    ["window", "pool"],
)
FIGURES_AT = Gauge(
    "ripplemesh_ledger_figures_timestamp_seconds",
    "When the ledger last refreshed its figures from the database.",
)

_worker_decoder = msgspec.json.Decoder(WorkerState)


class GroupCommit:
    """One writer records the events its concurrent handlers hand it, many per transaction.

    Each handler still acks only after its own event is committed; batching only amortises the
    transaction (and the database round trips) over everything that arrived meanwhile.
    `on_batch` sees what each committed batch changed (the workflows to put in WORKFLOW_SPEND).
    """

    def __init__(
        self,
        store: LedgerStore,
        prices: Mapping[str, float],
        max_batch: int = 512,
        gather_s: float = 0.02,
        *,
        kv_usd_per_gb: float = 0.0,
        on_batch: Callable[[BatchResult], None] | None = None,
    ):
        self.store = store
        self.gather_s = gather_s
        self.prices = prices
        self.kv_usd_per_gb = kv_usd_per_gb
        self.on_batch = on_batch
        self.max_batch = max_batch
        self._queue: asyncio.Queue[tuple[LifecycleEvent, asyncio.Future[bool]]] = asyncio.Queue()

    async def record(self, event: LifecycleEvent) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((event, done))
        async with asyncio.timeout(30.0):  # one timer, where wait_for would add a task per event
            return await done

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # Nothing waits on the ledger's acks, so gather for a moment: a transaction costs
            # about the same for one event as for hundreds.
            await asyncio.sleep(self.gather_s)
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            waiting = [(event, done) for event, done in batch if not done.done()]
            try:
                result = await self.store.record_batch(
                    [event for event, _ in waiting], self.prices, kv_usd_per_gb=self.kv_usd_per_gb
                )
            except asyncio.CancelledError:
                for _, done in waiting:
                    done.cancel()
                raise
            except Exception as exc:  # the handlers nak and their events come back
                for _, done in waiting:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for (_, done), flag in zip(waiting, result.flags, strict=True):
                if not done.done():
                    done.set_result(flag)
            if self.on_batch is not None:
                try:
                    self.on_batch(result)
                except Exception as exc:
                    log.warning("batch callback failed", extra={"error": repr(exc)})


class LedgerService:
    name: ClassVar[str] = "ledger"
    # Nothing waits on the ledger: it yields the CPU to the services on the requests' path.
    background: ClassVar[bool] = True

    IDLE_SAMPLE_S: ClassVar[float] = 5.0
    IDLE_WINDOW_S: ClassVar[float] = 60.0
    FIGURES_EVERY_S: ClassVar[float] = 15.0
    FIGURES_WINDOW_S: ClassVar[float] = 3600.0
    FIGURES_WINDOW: ClassVar[str] = "1h"
    SWEEP_EVERY_S: ClassVar[float] = 15.0

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.store: LedgerStore | None = None
        self.writer: GroupCommit | None = None
        self.spend: WorkflowSpendPublisher | None = None
        self.task_timeout_s = 600.0
        self.recorded = 0
        self.duplicates = 0
        self.idle_samples = 0
        # Prefill costs of requests still decoding, for the request cost histogram.
        self._prefill_costs = _PendingCosts()

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        url = runtime.options.extra.get("database_url") or default_database_url(runtime.options.data_dir)
        self.store = await LedgerStore.open(url)
        log.info("ledger store open", extra={"dialect": self.store.dialect})
        config = runtime.config
        self.task_timeout_s = float(runtime.options.extra.get("task_timeout_s") or config.task_timeout_s)
        bus = runtime.bus

        def bucket() -> Awaitable[Any]:
            return bus.key_value(WORKFLOW_SPEND)

        self.spend = WorkflowSpendPublisher(self.store, bucket, self.task_timeout_s)
        self.writer = GroupCommit(
            self.store,
            config.gpu_prices_per_hour,
            kv_usd_per_gb=config.kv_transfer_usd_per_gb,
            on_batch=self._on_batch,
        )
        runtime.spawn(self.writer.run(), "ledger-writer")
        runtime.spawn(self.spend.run(), "ledger-workflow-spend")
        for interval, tick, name in (
            (self.IDLE_SAMPLE_S, self.sample_idle, "ledger-idle"),
            (self.SWEEP_EVERY_S, self.sweep_workflows, "ledger-sweep"),
            (self.FIGURES_EVERY_S, self.refresh_figures, "ledger-figures"),
        ):
            runtime.spawn(runtime.every(interval, tick, name), name)
        await runtime.consume(LEDGER_CONSUMER, LifecycleEvent, self._on_event, max_inflight=512)

    async def stop(self) -> None:
        if self.store is not None:
            await self.store.close()
            self.store = None

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/ledger/totals", self._totals, methods=["GET"]),
            Route("/v1/ledger/requests/{request_id}", self._request, methods=["GET"]),
            Route("/v1/ledger/tenants", self._tenants, methods=["GET"]),
            Route("/v1/ledger/classes", self._classes, methods=["GET"]),
            Route("/v1/ledger/models", self._models, methods=["GET"]),
            Route("/v1/ledger/report", self._report, methods=["GET"]),
            Route("/v1/ledger/workflows/{workflow_id}", self._workflow, methods=["GET"]),
        ]

    def health(self) -> dict[str, Any]:
        return {
            "ledger_database": self.store.dialect if self.store else None,
            "events_recorded": self.recorded,
            "events_duplicate": self.duplicates,
            "idle_samples": self.idle_samples,
            "workflow_spend_puts": self.spend.published if self.spend else 0,
        }

    # ------------------------------------------------------------ periodic work

    def _on_batch(self, result: BatchResult) -> None:
        if self.spend is not None:
            self.spend.notify(result.workflows)

    async def sweep_workflows(self) -> None:
        """Put the workflows abandoned since the last sweep in WORKFLOW_SPEND."""
        if self.spend is not None:
            await self.spend.sweep()

    async def sample_idle(self) -> None:
        """Read every live worker's heartbeat and record its idle GPU time since the last sample."""
        assert self.runtime is not None and self.store is not None
        kv = await self.runtime.bus.key_value(WORKERS)
        keys = await kv_keys(self.runtime.bus.js, WORKERS.bucket)
        samples: list[WorkerSample] = []
        for key in keys:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue  # stopped meanwhile
            if entry.value is None:
                continue
            try:
                state = _worker_decoder.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("bad worker state ignored", extra={"key": key})
                continue
            samples.append(WorkerSample(state.worker_id, state.pool, state.gpu_type, state.started_at))
        result = await self.store.record_idle(
            samples,
            time.time(),
            self.runtime.config.gpu_prices_per_hour,
            window_s=self.IDLE_WINDOW_S,
            backfill_s=2 * self.IDLE_SAMPLE_S,
        )
        self.idle_samples += 1
        for share in result.shares:
            IDLE_SPEND.labels(share.pool).inc(share.idle_cost_usd)
            IDLE_GPU_SECONDS.labels(share.pool).inc(share.idle_gpu_seconds)
        for error in result.errors:
            ERRORS.labels("idle").inc()
            log.warning("idle time not priced", extra={"worker_id": error.worker_id, "reason": error.reason})

    async def refresh_figures(self) -> None:
        """The gauges: the figures of merit over the trailing window, fleet, tenants and pools."""
        assert self.store is not None
        now = time.time()
        since = now - self.FIGURES_WINDOW_S
        window = self.FIGURES_WINDOW
        figures = {
            by: await self.store.figures(now=now, task_timeout_s=self.task_timeout_s, since=since, by=by)
            for by in (None, "tenant", "pool")
        }
        fleet = figures[None].get(None) or Figures()
        COST_PER_TASK.labels(window).set(_or_nan(fleet.cost_per_successful_task_usd))
        for kind, value in (
            ("total", fleet.spend_usd),
            ("gpu", fleet.gpu_spend_usd),
            ("kv_transfer", fleet.kv_transfer_spend_usd),
            ("idle", fleet.idle_spend_usd or 0.0),
            ("wasted", fleet.wasted_spend_usd),
        ):
            WINDOW_SPEND.labels(window, kind).set(value)
        for status, count in (
            ("succeeded", fleet.tasks_succeeded),
            ("failed", fleet.tasks_failed),
            ("running", fleet.tasks_running),
        ):
            WINDOW_TASKS.labels(window, status).set(count)
        for reason, count in fleet.failed_by_reason.items():
            WINDOW_FAILED.labels(window, reason).set(count)
        for gauge in (TENANT_SPEND, TENANT_COST_PER_TASK, TENANT_TASKS, POOL_SPEND, POOL_COST_PER_TASK):
            gauge.clear()  # tenants and pools that left the window
        for tenant, f in figures["tenant"].items():
            TENANT_SPEND.labels(window, tenant, "total").set(f.spend_usd)
            TENANT_SPEND.labels(window, tenant, "wasted").set(f.wasted_spend_usd)
            TENANT_COST_PER_TASK.labels(window, tenant).set(_or_nan(f.cost_per_successful_task_usd))
            TENANT_TASKS.labels(window, tenant, "succeeded").set(f.tasks_succeeded)
            TENANT_TASKS.labels(window, tenant, "failed").set(f.tasks_failed)
            TENANT_TASKS.labels(window, tenant, "running").set(f.tasks_running)
        for pool, f in figures["pool"].items():
            POOL_SPEND.labels(window, pool, "total").set(f.spend_usd)
            POOL_SPEND.labels(window, pool, "busy").set(f.busy_spend_usd)
            POOL_SPEND.labels(window, pool, "idle").set(f.idle_spend_usd or 0.0)
            POOL_SPEND.labels(window, pool, "wasted").set(f.wasted_spend_usd)
            POOL_COST_PER_TASK.labels(window, pool).set(_or_nan(f.cost_per_successful_task_usd))
        FIGURES_AT.set(now)

    # ------------------------------------------------------------ consuming

    async def _on_event(self, event: LifecycleEvent, delivery: Delivery) -> None:
        assert self.runtime is not None and self.store is not None
        prices = self.runtime.config.gpu_prices_per_hour
        kind = type(event).__struct_config__.tag
        # On the consumer's span (which carries the request id): a span of its own per event
        # would cost the ledger about a tenth of its CPU.
        span = trace.get_current_span()
        span.set_attribute("ripple.event.type", str(kind))
        # The store prices the event again, in its transaction; this copy is for telemetry.
        cost, unpriced = _cost_of(event, prices)
        assert self.writer is not None
        recorded = await self.writer.record(event)
        span.set_attribute("ripple.ledger.duplicate", not recorded)
        if recorded and cost is not None:
            span.set_attribute(COST_USD, cost)
        if recorded and unpriced is not None:
            span.set_attribute("ripple.ledger.error", unpriced)
        if not recorded:
            self.duplicates += 1
            EVENTS.labels(kind, "duplicate").inc()
            return
        self.recorded += 1
        EVENTS.labels(kind, "recorded").inc()
        if unpriced is not None:
            ERRORS.labels(kind).inc()
            log.warning(
                "GPU time not priced",
                extra={"event_id": event.event_id, "type": kind, "reason": unpriced},
            )
        if cost and isinstance(event, PrefillCompleted | DecodeCompleted):
            phase = "prefill" if isinstance(event, PrefillCompleted) else "decode"
            SPEND.labels(event.tenant, phase).inc(cost)
        kv_cost = 0.0
        if isinstance(event, DecodeCompleted) and event.kv_transfer_bytes:
            kv_price = self.runtime.config.kv_transfer_usd_per_gb
            with contextlib.suppress(PricingError):
                kv_cost = price_kv_transfer(event.kv_transfer_bytes, kv_price)
                SPEND.labels(event.tenant, "kv_transfer").inc(kv_cost)
        if isinstance(event, PrefillCompleted) and cost:
            self._prefill_costs.put(event.request_id, cost)
        elif isinstance(event, DecodeCompleted):
            # The request's whole cost, its trace the exemplar: a panel's spike leads to it.
            total = (cost or 0.0) + kv_cost + self._prefill_costs.pop(event.request_id)
            context = span.get_span_context()
            exemplar = {"trace_id": f"{context.trace_id:032x}"} if context.is_valid else None
            REQUEST_COST.labels(event.tenant, event.priority or "unknown").observe(total, exemplar)

    # ------------------------------------------------------------ HTTP

    async def _totals(self, _: Request) -> JSONResponse:
        assert self.store is not None
        return JSONResponse(await self.store.totals())

    async def _request(self, request: Request) -> JSONResponse:
        assert self.store is not None
        request_id = request.path_params["request_id"]
        row = await self.store.request(request_id)
        if row is None:
            return JSONResponse({"error": "unknown request", "request_id": request_id}, status_code=404)
        return JSONResponse(row)

    async def _tenants(self, _: Request) -> JSONResponse:
        assert self.store is not None
        return JSONResponse({"tenants": await self.store.by_tenant()})

    async def _classes(self, _: Request) -> JSONResponse:
        """Interactive requests and Batch API lines apart: their spend and cost per completion."""
        assert self.store is not None
        return JSONResponse({"classes": await self.store.by_class()})

    async def _models(self, _: Request) -> JSONResponse:
        """Each model's requests, spend and cost per completion."""
        assert self.store is not None
        return JSONResponse({"models": await self.store.by_model()})

    async def _report(self, request: Request) -> JSONResponse:
        """The figures of merit, for the fleet and by tenant, pool or workflow."""
        assert self.store is not None
        params = request.query_params
        now = time.time()
        by = params.get("by") or None
        if by is not None and by not in DIMENSIONS:
            return _bad_request(f"by must be one of {', '.join(DIMENSIONS)}, not {by!r}")
        try:
            since = parse_since(params["since"], now) if params.get("since") else None
            limit = int(params.get("limit", "100"))
        except (SinceError, ValueError) as exc:
            return _bad_request(str(exc))
        report = await self.store.report(
            now=now,
            task_timeout_s=self.task_timeout_s,
            since=since,
            by=by,
            limit=max(1, limit),
        )
        return JSONResponse(_json_safe(report))

    async def _workflow(self, request: Request) -> JSONResponse:
        assert self.store is not None
        workflow_id = request.path_params["workflow_id"]
        found = await self.store.tasks([workflow_key(workflow_id)])
        if not found:
            return JSONResponse({"error": "unknown workflow", "workflow_id": workflow_id}, status_code=404)
        facts = found[0]
        status, reason = status_of(facts, time.time(), self.task_timeout_s)
        return JSONResponse(
            _json_safe(
                {
                    **{name: getattr(facts, name) for name in facts.__dataclass_fields__},
                    "spend_usd": facts.spend_usd,
                    "status": status,
                    "reason": reason,
                }
            )
        )


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _json_safe(value: Any) -> Any:
    """NaN and infinities (never expected) as null: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _cost_of(event: LifecycleEvent, prices: Mapping[str, float]) -> tuple[float | None, str | None]:
    """(cost in US$, None) for a priced completion, (None, reason) if it cannot be priced,
    (None, None) for events that carry no GPU time."""
    if not isinstance(event, PrefillCompleted | DecodeCompleted):
        return None, None
    try:
        return price_gpu_seconds(event.gpu_type, event.gpu_seconds, prices), None
    except PricingError as exc:
        return None, str(exc)
