"""Ledger service: consume every lifecycle event, record its cost (store.py), serve the totals.

Database: ``--extra database_url=...`` (SQLite or PostgreSQL, see store.py), else
``<data_dir>/ledger.db``. Prices: the mesh config's ``gpu_prices_per_hour``.

HTTP: ``GET /v1/ledger/totals``, ``GET /v1/ledger/requests/{request_id}``,
``GET /v1/ledger/tenants``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from schemas.events import DecodeCompleted, FleetObserved, LifecycleEvent, PrefillCompleted
from schemas.subjects import LEDGER_CONSUMER
from services.ledger.pricing import PricingError, price_gpu_seconds
from services.ledger.store import LedgerStore
from services.mesh.consumer import Delivery
from services.mesh.runtime import Runtime
from services.mesh.tracing import REQUEST_ID, tracer

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
SPEND = Counter(
    "ripplemesh_ledger_spend_usd_total",
    "GPU spend recorded by the ledger, in US$, by tenant and phase.",
    ["tenant", "phase"],
)


def default_database_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{Path(data_dir).resolve() / 'ledger.db'}"


class GroupCommit:
    """One writer records the events its concurrent handlers hand it, many per transaction.

    Each handler still acks only after its own event is committed; batching only amortises the
    transaction (and the database round trips) over everything that arrived meanwhile.
    """

    def __init__(
        self,
        store: LedgerStore,
        prices: Mapping[str, float],
        max_batch: int = 512,
        gather_s: float = 0.02,
    ):
        self.store = store
        self.gather_s = gather_s
        self.prices = prices
        self.max_batch = max_batch
        self._queue: asyncio.Queue[tuple[LifecycleEvent, asyncio.Future[bool]]] = asyncio.Queue()

    async def record(self, event: LifecycleEvent) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((event, done))
        return await asyncio.wait_for(done, timeout=30.0)

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
                flags = await self.store.record_many([event for event, _ in waiting], self.prices)
            except asyncio.CancelledError:
                for _, done in waiting:
                    done.cancel()
                raise
            except Exception as exc:  # the handlers nak and their events come back
                for _, done in waiting:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for (_, done), flag in zip(waiting, flags, strict=True):
                if not done.done():
                    done.set_result(flag)


class LedgerService:
    name: ClassVar[str] = "ledger"

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.store: LedgerStore | None = None
        self.writer: GroupCommit | None = None
        self.recorded = 0
        self.duplicates = 0

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        url = runtime.options.extra.get("database_url") or default_database_url(runtime.options.data_dir)
        self.store = await LedgerStore.open(url)
        log.info("ledger store open", extra={"dialect": self.store.dialect})
        self.writer = GroupCommit(self.store, runtime.config.gpu_prices_per_hour)
        runtime.spawn(self.writer.run(), "ledger-writer")
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
        ]

    def health(self) -> dict[str, Any]:
        return {
            "ledger_database": self.store.dialect if self.store else None,
            "events_recorded": self.recorded,
            "events_duplicate": self.duplicates,
        }

    # ------------------------------------------------------------ consuming

    async def _on_event(self, event: LifecycleEvent, delivery: Delivery) -> None:
        assert self.runtime is not None and self.store is not None
        prices = self.runtime.config.gpu_prices_per_hour
        kind = type(event).__struct_config__.tag
        with tracer().start_as_current_span("ledger.record") as span:
            if not isinstance(event, FleetObserved):
                span.set_attribute(REQUEST_ID, event.request_id)
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


def _cost_of(event: LifecycleEvent, prices: Mapping[str, float]) -> tuple[float | None, str | None]:
    """(cost in US$, None) for a priced completion, (None, reason) if it cannot be priced,
    (None, None) for events that carry no GPU time."""
    if not isinstance(event, PrefillCompleted | DecodeCompleted):
        return None, None
    try:
        return price_gpu_seconds(event.gpu_type, event.gpu_seconds, prices), None
    except PricingError as exc:
        return None, str(exc)
