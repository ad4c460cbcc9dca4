"""Prefill worker: compute a prompt's KV (only the uncached part), stream the first token, and
hand the KV to the decode worker the router chose."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from starlette.routing import BaseRoute

from schemas.events import DecodeWork, PrefillWork, derived_event_id
from schemas.subjects import work_subject, worker_consumer
from services.engines.base import EngineError, PrefillResult
from services.engines.factory import make_engine
from services.engines.host import EngineHost
from services.mesh.consumer import Delivery
from services.mesh.runtime import Runtime


class PrefillService:
    name: ClassVar[str] = "prefill"

    def __init__(self) -> None:
        self.host: EngineHost | None = None

    async def start(self, runtime: Runtime) -> None:
        settings = runtime.options.extra
        worker_id = settings["worker_id"]
        engine = make_engine({**settings, "role": "prefill"}, runtime.config)
        self.host = EngineHost(
            runtime,
            engine,
            worker_id=worker_id,
            role="prefill",
            pool=settings.get("pool") or f"prefill-{engine.info.gpu_type}",
        )
        await self.host.start()
        await runtime.consume(
            worker_consumer("prefill", worker_id),
            PrefillWork,
            self.host.lifecycle.guarded(self._on_work),
            max_inflight=256,
            direct=True,
        )

    async def stop(self) -> None:
        if self.host is not None:
            await self.host.stop()

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        return self.host.health() if self.host else {}

    async def _on_work(self, work: PrefillWork, delivery: Delivery) -> None:
        host = self.host
        assert host is not None
        request = work.request

        async def hand_off(result: PrefillResult) -> None:
            await host.runtime.bus.publish(
                work_subject("decode", work.decode_worker),
                DecodeWork(
                    event_id=derived_event_id(work.event_id, "decode"),
                    occurred_at=time.time(),
                    request=request,
                    prefill_worker=host.worker_id,
                    decode_worker=work.decode_worker,
                    kv=await host.export_kv(request.request_id, result.kv),
                    first_token_id=result.first_token_id,
                    cached_tokens=result.cached_tokens,
                ),
            )

        try:
            await host.prefill(
                request,
                work.event_id,
                hand_off,
                routed_at=work.occurred_at,
                prediction=work.prediction,
                placed_by=work.decision_traceparent,
            )
        except EngineError as exc:
            await host.fail(request, 0, exc, work.event_id)
        finally:
            # The prompt's blocks stay in this worker's prefix cache for the next request.
            host.engine.release(request.request_id)
