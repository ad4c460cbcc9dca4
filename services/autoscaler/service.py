"""Autoscaler: every few seconds read the workers' state, plan each pool's size (policy.py) and
publish the view as a `FleetObserved` event. It recommends; acting on it comes later."""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import msgspec
from nats.js.errors import NoKeysError
from prometheus_client import Gauge
from starlette.routing import BaseRoute

from schemas.events import FleetObserved, PoolView, WorkerState, new_event_id
from schemas.subjects import WORKERS, event_subject
from services.autoscaler.policy import PoolPlan, Targets, WorkerLoad, plan
from services.mesh.runtime import Runtime
from services.mesh.tracing import tracer

log = logging.getLogger(__name__)

REPLICAS = Gauge("ripplemesh_autoscaler_replicas", "Live replicas per pool.", ["pool"])
DESIRED = Gauge("ripplemesh_autoscaler_desired_replicas", "Recommended replicas per pool.", ["pool"])

_decoder = msgspec.json.Decoder(WorkerState)


class AutoscalerService:
    name: ClassVar[str] = "autoscaler"
    background: ClassVar[bool] = True  # see services.mesh.runtime.BACKGROUND_NICENESS

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.targets = Targets()
        self.last_plan: list[PoolPlan] = []

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        interval = float(runtime.options.extra.get("interval_s", 5.0))
        runtime.spawn(runtime.every(interval, self.observe, "observe"), "observe")

    async def stop(self) -> None:
        return None

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        return {"pools": len(self.last_plan)}

    async def _worker_loads(self) -> list[WorkerLoad]:
        assert self.runtime is not None
        kv = await self.runtime.bus.key_value(WORKERS)
        try:
            keys = await kv.keys()
        except NoKeysError:
            return []
        loads = []
        for key in keys:
            entry = await kv.get(key)
            if entry.value is None:
                continue
            try:
                state = _decoder.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("bad worker state ignored", extra={"key": key})
                continue
            loads.append(
                WorkerLoad(
                    state.worker_id,
                    state.pool,
                    state.role,
                    state.gpu_type,
                    state.queue_depth,
                    state.running,
                    state.kv_blocks_used,
                    state.kv_blocks_total,
                    state.occurred_at,
                )
            )
        return loads

    async def observe(self) -> None:
        assert self.runtime is not None
        with tracer().start_as_current_span("autoscaler.observe") as span:
            self.last_plan = plan(await self._worker_loads(), self.targets, time.time())
            span.set_attribute("ripple.autoscaler.pools", len(self.last_plan))
            for pool in self.last_plan:
                REPLICAS.labels(pool.pool).set(pool.replicas)
                DESIRED.labels(pool.pool).set(pool.desired_replicas)
            await self.runtime.bus.publish(
                event_subject("fleet"),
                FleetObserved(
                    event_id=new_event_id(),
                    occurred_at=time.time(),
                    pools=[
                        PoolView(
                            pool=p.pool,
                            role=p.role,
                            gpu_type=p.gpu_type,
                            replicas=p.replicas,
                            desired_replicas=p.desired_replicas,
                            queue_depth=p.queue_depth,
                            running=p.running,
                            kv_utilisation=p.kv_utilisation,
                            reason=p.reason,
                        )
                        for p in self.last_plan
                    ],
                ),
            )
